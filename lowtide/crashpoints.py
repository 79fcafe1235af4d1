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
"""The submit path's points (tests/integration/test_crash.py runs each on the emulator)."""

QUEUE_POINTS = ("waiting_for_room",)  # batches sent, the next waits for the provider's queue

POOL_POINTS = ("during_stream",)  # vllm backend: after a group of answers was committed

PREPARE_POINTS = (
    "mid_sources",  # the first slice of the run's input rows committed, the rest not yet
    "during_load",  # the run's input rows saved, units not yet made
    "after_dedupe",  # units saved, no manifest yet
    "mid_assembly",  # request template saved, the manifest not yet
    "mid_manifest",  # the first slice of requests committed, no batch rows yet
)

ROUND_POINTS = (
    "mid_parse",  # parsed batches' results upserted, the batches not yet marked collected
    "in_retry_round",  # a retry round's manifest committed, nothing of it sent
    "in_realtime",  # a realtime batch's answers committed, the batch not yet marked complete
)

PUBLISH_POINTS = ("mid_publish",)  # the run finished in the store, the published file not swapped

RELEASE_POINTS = ("before_release",)
"""Batches collected (their results committed), what the provider keeps of them not yet deleted
(tests/integration/test_leftovers.py: the next collect, or `lowtide leftovers`, deletes it)."""

ALL_POINTS = (
    *PREPARE_POINTS,
    *POINTS,
    *QUEUE_POINTS,
    *ROUND_POINTS,
    *RELEASE_POINTS,
    *POOL_POINTS,
    *PUBLISH_POINTS,
)
"""Every crash point in pipeline order (tests/integration/test_crash_matrix.py kills a run at
each, on every backend where it applies)."""


def crash_point(name: str) -> None:
    if crash_point_armed() == name:
        os.kill(os.getpid(), signal.SIGKILL)
