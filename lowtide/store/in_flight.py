"""Which runs `collect` has to drive: unfinished runs that have batches.

The scheduled `collect` usually finds none; `any_in_flight` answers that from the state file with
plain DuckDB (no polars, no Prefect), so an idle tick costs well under a second.
"""

from __future__ import annotations

from pathlib import Path

from lowtide.store._db import Database
from lowtide.vocabulary import IN_FLIGHT_RUN, sql_list

IN_FLIGHT_WHERE = "list_contains(?, status) AND run_id IN (SELECT run_id FROM batches)"
"""The runs `collect` drives (one parameter: `in_flight_statuses()`)."""


def in_flight_statuses() -> list[str]:
    return sql_list(IN_FLIGHT_RUN)


def any_in_flight(state: Path, lock_timeout_s: float) -> bool:
    """Whether any run in the state file is in flight (False when there is no state file)."""
    if not state.is_file():
        return False
    found = Database(state, lock_timeout_s)._scalar(
        f"SELECT count(*) FROM runs WHERE {IN_FLIGHT_WHERE}", [in_flight_statuses()]
    )
    return bool(found)
