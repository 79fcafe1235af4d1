"""Ctrl-C and SIGTERM through DuckDB.

DuckDB runs Python's signal handlers while a query executes, and whatever a handler raises
(KeyboardInterrupt on Ctrl-C, `Terminated` on SIGTERM, Prefect's own on a cancellation) comes
out of the query as `RuntimeError("Query interrupted")`. Left so, an interrupt is a failure:
a flow records it as the run's error, a task with retries runs again, and the CLI prints a
traceback instead of its one line. Handlers here note what they raise, and `kept_through_duckdb`
puts it back where the query returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

_QUERY_INTERRUPTED = "Query interrupted"  # DuckDB's message for a query a signal stopped

_raised: BaseException | None = None  # what the last handler raised; handlers run in main


def raise_from_signal(exc: BaseException) -> NoReturn:
    """Raise `exc` from a signal handler, noted so a DuckDB query it stops hands it back."""
    global _raised
    _raised = exc
    raise exc


def is_interrupt(error: BaseException) -> bool:
    """Whether `error` is a signal's interrupt, as raised or as DuckDB reports it."""
    import duckdb  # here: the CLI asks only when something failed, and starts without it

    if isinstance(error, KeyboardInterrupt | duckdb.InterruptException):
        return True
    return type(error) is RuntimeError and str(error) == _QUERY_INTERRUPTED


def interrupt_for(error: BaseException) -> BaseException:
    """The exception a signal raised that `error` stands for: the noted one, or
    KeyboardInterrupt (Python's own Ctrl-C handler raised it)."""
    global _raised
    noted, _raised = _raised, None
    return noted if noted is not None else KeyboardInterrupt()


def raise_if_interrupt(error: BaseException) -> None:
    """Before an error is recorded as a failure: an interrupt is raised as itself instead."""
    if is_interrupt(error) and not isinstance(error, KeyboardInterrupt):
        raise interrupt_for(error) from error


@contextmanager
def kept_through_duckdb() -> Iterator[None]:
    """DuckDB's report of a query a signal stopped becomes the signal's own exception again."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - only interrupts are replaced, the rest re-raised
        raise_if_interrupt(e)
        raise
