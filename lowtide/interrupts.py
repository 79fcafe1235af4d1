"""Ctrl-C and SIGTERM through DuckDB.

DuckDB runs Python's signal handlers while a query executes, and whatever a handler raises
(KeyboardInterrupt on Ctrl-C, the CLI's `Terminated` on SIGTERM) comes out of the query as
`RuntimeError("Query interrupted")`. Left so, an interrupt is a failure: a flow records it as
the run's error and the CLI prints a traceback instead of its one line. The CLI's handler
notes what it raises, and `kept_through_duckdb` puts it back where the query returns; what a
handler of someone else's raised comes back as KeyboardInterrupt, which Prefect also treats as
the run ending, not failing; while Prefect's runner cancels the flow run, as Prefect's
TerminationSignal, so the run ends Cancelled rather than Crashed.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

_QUERY_INTERRUPTED = "Query interrupted"  # DuckDB's message for a query a signal stopped

_raised: BaseException | None = None  # what the CLI's handler raised; handlers run in main


def raise_from_signal(exc: BaseException) -> NoReturn:
    """Raise `exc` from a signal handler, noted so a DuckDB query it stops hands it back."""
    global _raised
    _raised = exc
    raise exc


def forget_signal() -> None:
    """Once a handler's exception has been dealt with (or its handler is gone): a later Ctrl-C
    must not come back as it."""
    global _raised
    _raised = None


def is_interrupt(error: BaseException) -> bool:
    """Whether `error` is a signal's interrupt, as raised or as DuckDB reports it."""
    if isinstance(error, KeyboardInterrupt):
        return True
    if type(error) is RuntimeError:
        return str(error) == _QUERY_INTERRUPTED
    duckdb = sys.modules.get("duckdb")  # not loaded, no DuckDB error (the CLI starts without it)
    return duckdb is not None and isinstance(error, duckdb.InterruptException)


def interrupt_for(error: BaseException) -> BaseException:
    """The exception a signal raised that `error` stands for: the noted one; Prefect's
    TerminationSignal while its runner cancels this flow run; else KeyboardInterrupt (Python's
    own Ctrl-C handler raised it)."""
    noted = _raised
    forget_signal()
    if noted is not None:
        return noted
    return _prefect_cancelling() or KeyboardInterrupt()


def _prefect_cancelling() -> BaseException | None:
    """What Prefect's SIGTERM handler raised, when its runner is cancelling this flow run.

    A cancel from the UI reaches a deployment's process as the runner's recorded intent, then
    SIGTERM, which Prefect's handler turns into TerminationSignal; the engine reads the intent
    and ends the run Cancelled. Landing inside a DuckDB query, that exception is lost, and as
    KeyboardInterrupt the run would end Crashed. Prefect's internals (pinned version); without
    them, None."""
    if "prefect" not in sys.modules:  # no flow run in this process
        return None
    try:
        from prefect._internal.control_listener import get_intent
        from prefect.exceptions import TerminationSignal
        from prefect.utilities.engine import is_prefect_sigterm_handler_installed
    except ImportError:
        return None
    if get_intent() is None or not is_prefect_sigterm_handler_installed():
        return None
    return TerminationSignal(signal=signal.SIGTERM)


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
