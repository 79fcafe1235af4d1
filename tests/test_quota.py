"""The rule that decides whether the next batch may be created, on numbers alone."""

from __future__ import annotations

import math

import pytest

from lowtide.quota import (
    PLANNING_SHARE,
    Batch,
    QueueLimits,
    QueueUsage,
    limits_from,
    room_for,
)

NOW = 1_000_000.0


def _room(batch: Batch, limits: QueueLimits, usage: QueueUsage, probe: bool = False) -> str | None:
    return room_for(batch, limits, usage, now=NOW, probe=probe)


@pytest.mark.parametrize(
    ("tokens", "queued", "fits"),
    [
        (30_000, 0, True),  # an empty queue takes it
        (30_000, 60_000, True),  # 90,000 ≤ 97% of 100,000
        (30_000, 68_000, False),  # 98,000 > 97,000
        (120_000, 0, True),  # larger than the queue, nothing else in flight: the provider says
        (120_000, 1, False),
    ],
)
def test_token_limit(tokens: int, queued: int, fits: bool) -> None:
    limits = QueueLimits(enqueued_tokens=100_000)
    why = _room(Batch(tokens, 10), limits, QueueUsage(tokens=queued))
    assert (why is None) is fits
    if not fits:
        assert "enqueued tokens" in why


def test_planning_leaves_room_for_estimates() -> None:
    assert 0.9 < PLANNING_SHARE < 1


def test_request_limit_counts_all_models() -> None:
    limits = QueueLimits(queued_requests=100)
    assert _room(Batch(0, 40), limits, QueueUsage(requests=60)) is None
    assert "requests" in _room(Batch(0, 41), limits, QueueUsage(requests=60))


def test_a_providers_wait_holds_every_batch_until_it_passes() -> None:
    limits = QueueLimits(not_before=NOW + 30)
    assert "wait 30 s" in _room(Batch(1, 1), limits, QueueUsage())
    assert room_for(Batch(1, 1), limits, QueueUsage(), now=NOW + 30, probe=False) is None


def test_create_rate() -> None:
    limits = QueueLimits(batches_per_hour=2000)
    assert _room(Batch(1, 1), limits, QueueUsage(creates_last_hour=1999)) is None
    assert "last hour" in _room(Batch(1, 1), limits, QueueUsage(creates_last_hour=2000))


def test_an_unknown_token_limit_probes_one_batch_at_a_time() -> None:
    unknown = QueueLimits()
    assert _room(Batch(10**9, 1), unknown, QueueUsage(unadmitted=0), probe=True) is None
    assert "admitted" in _room(Batch(1, 1), unknown, QueueUsage(unadmitted=1), probe=True)
    # a provider whose breach is a 429 (Anthropic) needs no probing
    assert _room(Batch(1, 1), unknown, QueueUsage(unadmitted=5), probe=False) is None
    # a limit known to be absent is not unknown
    absent = QueueLimits(enqueued_tokens=math.inf)
    assert _room(Batch(10**9, 1), absent, QueueUsage(unadmitted=3), probe=True) is None


def test_limits_from_stored_values() -> None:
    limits = limits_from(
        {"enqueued_tokens": 2e6, "queued_requests": math.nan, "not_before": 5.0, "other": 1.0}
    )
    assert limits == QueueLimits(enqueued_tokens=2e6, not_before=5.0)
