"""Named crash points for deterministic crash tests.

A test arms one by setting LOWTIDE_CRASH_AT=<name> (`Settings.crash_at`) in a subprocess's
environment; when the code reaches `crash_point(name)` the process kills itself with SIGKILL,
exactly there, leaving the store as a real crash would. Unarmed, a crash point costs one
environment lookup.
"""

from __future__ import annotations

import os
import signal

from lowtide.settings import crash_point_armed

POINTS = (
    "after_manifest",  # requests and pending batches committed, nothing uploaded
    "after_upload",  # input file accepted by the provider, id committed
    "after_create",  # provider created the batch, its id NOT yet committed
    "during_poll",  # batch ids committed, waiting for the provider
    "during_download",  # results downloaded but not yet stored
)

POOL_POINTS = ("during_stream",)  # vllm backend: after a group of answers was committed


def crash_point(name: str) -> None:
    if crash_point_armed() == name:
        os.kill(os.getpid(), signal.SIGKILL)
