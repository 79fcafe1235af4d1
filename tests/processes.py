"""Waiting for processes to end on the kernel's word, not on a clock.

A test that kills a run checks that whatever the run started follows it out. It waits on a
pidfd per process (readable once the process has exited), so a busy machine only makes the
wait longer, never the test fail; the test's own timeout is the one bound on a hang, and
whatever is still running when the wait ends early (that timeout, Ctrl-C) is killed so that
nothing leaks into the rest of the suite."""

from __future__ import annotations

import contextlib
import os
import select
import signal


def wait_for_exit(pids: list[int]) -> None:
    """Return once every process in `pids` has exited (one already gone counts)."""
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
    except BaseException:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        raise
