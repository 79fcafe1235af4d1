"""A tiny progress channel from tasks to whoever is watching (the CLI's rich display, the
Prefect progress artifact).

Tasks run in the flow's process, so process-wide listeners are enough; with none, reporting
does nothing.
"""

from __future__ import annotations

from collections.abc import Callable

Reporter = Callable[[str, int, int, str], None]
_listeners: list[Reporter] = []


def add_listener(listener: Reporter) -> None:
    _listeners.append(listener)


def remove_listener(listener: Reporter) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def set_reporter(reporter: Reporter | None) -> None:
    """Replace every listener by `reporter` (None: no listener)."""
    _listeners.clear()
    if reporter is not None:
        _listeners.append(reporter)


def report(stage: str, done: int = 0, total: int = 0, note: str = "") -> None:
    for listener in list(_listeners):
        listener(stage, done, total, note)
