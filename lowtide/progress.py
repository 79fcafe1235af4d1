"""A tiny progress channel from tasks to whoever is watching (the CLI's rich display).

Tasks run in the flow's process, so a process-wide reporter is enough; with no reporter set,
reporting does nothing.
"""

from __future__ import annotations

from collections.abc import Callable

Reporter = Callable[[str, int, int, str], None]
_reporter: Reporter | None = None


def set_reporter(reporter: Reporter | None) -> None:
    global _reporter
    _reporter = reporter


def report(stage: str, done: int = 0, total: int = 0, note: str = "") -> None:
    if _reporter is not None:
        _reporter(stage, done, total, note)
