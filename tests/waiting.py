"""Waiting for something to happen without a deadline of our own.

A test that waits for another thread or process (a batch created, an engine executing, a worker
registered) checks for the event again and again until it happens. No wait here reads the clock:
on a busy machine the wait only gets longer, and the test's own timeout (pytest-timeout) is the
one bound on a hang. When that timeout interrupts a wait, the wait adds what it was waiting for
and the caller's explanation (a log tail) to the failure, so a hang still says why.

`still_going` lets a wait fail at once when what it waits for can no longer happen (the process
that would do it has exited)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from lowtide.emulator.ledger import BillingLedger

_RECHECK_S = 0.05  # between two looks; a pause, never a limit


def _nothing() -> str:
    return ""


def wait_until(
    check: Callable[[], bool],
    what: str,
    *,
    still_going: Callable[[], bool] = lambda: True,
    explain: Callable[[], str] = _nothing,
    recheck_s: float = _RECHECK_S,
) -> None:
    """Return once `check()` holds; fail when `still_going()` no longer does before that."""
    try:
        while not check():
            if not still_going():
                raise AssertionError(f"never happened: {what}\n{explain()}")
            if recheck_s:
                time.sleep(recheck_s)
    except AssertionError:
        raise
    except BaseException as exc:  # the test's timeout or Ctrl-C: say what was awaited
        exc.add_note(f"while waiting for: {what}\n{explain()}")
        raise


def wait_for_event(
    event: threading.Event,
    what: str,
    *,
    still_going: Callable[[], bool] = lambda: True,
    explain: Callable[[], str] = _nothing,
) -> None:
    """`wait_until` for an event: returns the moment it is set, not at the next look."""
    wait_until(
        lambda: event.wait(_RECHECK_S), what, still_going=still_going, explain=explain, recheck_s=0
    )


class CountingLedger(BillingLedger):
    """A billing ledger that sets `reached[k]` once its k-th execution is recorded, so a test
    can act on a number of executions as an event. Engines record on their own threads."""

    def __init__(self, *marks: int) -> None:
        super().__init__()
        self.reached = {k: threading.Event() for k in marks}
        self._count_lock = threading.Lock()
        self._count = 0

    def record(self, **fields: Any) -> Any:
        entry = super().record(**fields)
        with self._count_lock:  # two engines record at once
            self._count += 1
            n = self._count
        for k, reached in self.reached.items():
            if n >= k:
                reached.set()
        return entry
