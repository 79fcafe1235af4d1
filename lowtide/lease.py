"""Who drives a run: one process at a time (a waiting `enrich`, or a scheduled `collect`).

A lease is a row-level claim in the state file: the owner (host, pid, a token) and an expiry.
It is renewed while the run is driven and released at the end. A lease whose owner process on
this host is gone is free at once (a crash); one held from another host is free when it expires.
"""

from __future__ import annotations

import os
import secrets
import socket
from functools import lru_cache

LEASE_S = 900.0
"""How long a claim lasts without renewal; polling and streaming renew it far more often."""


class RunBusyError(RuntimeError):
    """Another live process is driving this run; it will finish it."""


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
