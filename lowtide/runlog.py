"""What each stage did, in the run's Logs tab: rows, units, requests, batches, seconds.

Inside a Prefect flow or task run the line goes to Prefect's run logger (so the UI shows it with
the run); elsewhere (a stage called directly in a test) to a plain `lowtide.<stage>` logger.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any


def stage_log(stage: str, message: str, *args: Any, level: int = logging.INFO) -> None:
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = logging.getLogger(
        f"lowtide.{stage}"
    )
    # where Prefect was not even imported (a flow run in-process), no run logger can exist
    if "prefect.context" in sys.modules:
        from prefect import get_run_logger
        from prefect.exceptions import MissingContextError

        with contextlib.suppress(MissingContextError):
            logger = get_run_logger()
    logger.log(level, f"{stage}: {message}", *args)
