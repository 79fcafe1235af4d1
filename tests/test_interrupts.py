"""An interrupted DuckDB query comes out as the interrupt, not as a failed query.

DuckDB runs Python's signal handlers while a query executes and reports whatever they raise as
RuntimeError("Query interrupted") (measured with DuckDB 2.0.1): a Ctrl-C in a state query once
failed a waiting run with a traceback instead of stopping it in one line (a CI run of
tests/integration/test_interrupt.py caught it). When a signal lands is not for a test to
choose, so these check the translation on DuckDB's own reports: its InterruptException from a
real interrupted query, and its signal message after a real signal handler ran.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from lowtide.interrupts import kept_through_duckdb, raise_from_signal
from lowtide.store import Store


class Stopped(BaseException):
    """What a handler of ours raises (the CLI's is `Terminated`)."""


@pytest.fixture
def noting_handler() -> Iterator[None]:
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: raise_from_signal(Stopped()))
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_an_interrupted_query_raises_keyboard_interrupt() -> None:
    con = duckdb.connect()
    done = threading.Event()

    def interrupt_until_done() -> None:  # the query never ends by itself: only this stops it
        while not done.wait(0.01):
            con.interrupt()

    threading.Thread(target=interrupt_until_done, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt) as caught, kept_through_duckdb():
            con.sql("SELECT sum(i) FROM range(9223372036854775807) t(i)").fetchall()
    finally:
        done.set()
        con.close()
    assert isinstance(caught.value.__cause__, duckdb.InterruptException)


@pytest.mark.usefixtures("noting_handler")
def test_a_query_a_handler_stopped_raises_what_the_handler_raised() -> None:
    with pytest.raises(Stopped) as caught, kept_through_duckdb():
        with contextlib.suppress(Stopped):  # the handler runs, as inside a query; DuckDB
            signal.raise_signal(signal.SIGUSR1)  # drops what it raised ...
        raise RuntimeError("Query interrupted")  # ... and reports this instead
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_ctrl_c_without_a_noted_handler_is_keyboard_interrupt_and_other_errors_pass() -> None:
    with pytest.raises(KeyboardInterrupt), kept_through_duckdb():
        raise RuntimeError("Query interrupted")  # Python's own Ctrl-C handler notes nothing
    with pytest.raises(RuntimeError, match="something else"), kept_through_duckdb():
        raise RuntimeError("something else")


def test_the_state_file_hands_back_interrupts(tmp_path: Path) -> None:
    """Every query on the state file runs inside `Store._connect`: an interrupt reported by
    DuckDB there is Ctrl-C again."""
    store = Store(tmp_path / "state.duckdb")
    with pytest.raises(KeyboardInterrupt), store._connect():
        raise RuntimeError("Query interrupted")
    assert store._scalar("SELECT 1") == 1  # and the file is usable afterwards


@pytest.fixture
def prefect_cancelling() -> Iterator[None]:
    """Prefect's SIGTERM handler installed, as around a flow run, and its runner's intent to
    cancel recorded, as a cancel from the UI records it before sending SIGTERM."""
    from prefect._internal import control_listener
    from prefect.utilities.engine import capture_sigterm

    with capture_sigterm():
        with control_listener._intent_lock:
            control_listener._intent = "cancel"
        try:
            yield
        finally:
            with control_listener._intent_lock:
                control_listener._intent = None


def test_a_query_stopped_by_prefects_cancel_raises_its_termination_signal(
    prefect_cancelling: None,
) -> None:
    """The engine ends a run Cancelled on TerminationSignal with the cancel intent, Crashed on
    KeyboardInterrupt: a cancel landing inside a query must come back as the former."""
    from prefect.exceptions import TerminationSignal

    with pytest.raises(TerminationSignal) as caught, kept_through_duckdb():
        with contextlib.suppress(TerminationSignal):  # Prefect's handler runs; DuckDB drops
            signal.raise_signal(signal.SIGTERM)  # what it raised ...
        raise RuntimeError("Query interrupted")  # ... and reports this instead
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert caught.value.signal == signal.SIGTERM


def test_without_a_cancel_intent_prefects_handler_leaves_keyboard_interrupt() -> None:
    from prefect.utilities.engine import capture_sigterm

    with capture_sigterm(), pytest.raises(KeyboardInterrupt), kept_through_duckdb():
        raise RuntimeError("Query interrupted")  # a Ctrl-C: no runner asked for anything
