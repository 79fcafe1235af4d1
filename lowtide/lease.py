"""Who drives a run: one process at a time (a waiting `enrich`, or a scheduled `collect`).

A lease is a row-level claim in the state file: the owner (host, pid, a token) and an expiry.
It is renewed while the run is driven and released at the end. A lease whose owner process on
this host is gone is free at once (a crash); one held from another host is free when it expires.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from lowtide.errors import RunBusyError

__all__ = ["LEASE_S", "RunBusyError", "driving", "owner_gone", "process_owner"]

LEASE_S = 900.0
"""How long a claim lasts without renewal; polling and streaming renew it far more often."""


@lru_cache(maxsize=1)
def process_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def owner_gone(owner: str | None) -> bool:
    """True when `owner` is a process of this host that no longer runs."""
    if not owner:
        return True
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@contextmanager
def driving(store: Any, run_id: str, lease_s: float = LEASE_S) -> Iterator[None]:
    """Hold the run's lease for the block; RunBusyError when another live process drives it."""
    owner = process_owner()
    holder = store.claim_run(run_id, owner, lease_s)
    if holder is not None:
        raise RunBusyError(
            f"run {run_id} is being driven by another lowtide process ({holder}), e.g. a "
            "scheduled collect; it will finish the run. `lowtide status` shows its progress.",
            run_id=run_id,
            holder=holder,
        )
    try:
        yield
    finally:
        store.release_run(run_id, owner)
