"""What each stage did, in the run's Logs tab: rows, units, requests, batches, seconds.

Inside a Prefect flow or task run the line goes to Prefect's run logger (so the UI shows it with
the run); elsewhere (a stage called directly in a test) to a plain `lowtide.<stage>` logger.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def stage_log(stage: str, message: str, *args: Any) -> None:
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger]
    try:
        logger = get_run_logger()
    except MissingContextError:
        logger = logging.getLogger(f"lowtide.{stage}")
    logger.info(f"{stage}: {message}", *args)
