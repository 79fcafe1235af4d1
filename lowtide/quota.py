"""How much a provider's batch queue takes now: the rule that decides whether the next batch
may be created, from the account's limits and what lowtide already has in flight there.

Real accounts cap what waits in a provider's queue: OpenAI (and Azure) the prompt tokens of a
model's unfinished batches, Anthropic the requests of all batches still processing, and both
the rate of batch creates. A run keeps the queue as full as those limits allow and no fuller;
nothing here does I/O, so the rule is tested on numbers alone (the store counts the usage,
`flows/enrich.py` asks before each create).

A limit comes from the job file (`[limits.<backend>]`), else from what the provider said before
(remembered in the state file), else from the emulator's own settings; unknown otherwise. While
OpenAI's token limit is unknown, a breach shows only when the batch fails validation, so one
batch at a time waits for admission (`probe`): the first refusal teaches the limit, and at most
one batch is refused for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PLANNING_SHARE = 0.97
"""Of a token limit, the share lowtide fills: its token counts are estimates (a counted sample's
tokens per byte), and a batch the provider counts larger than planned would be refused."""

HOUR_S = 3600.0

ENQUEUED_TOKENS = "enqueued_tokens"
QUEUED_REQUESTS = "queued_requests"
BATCHES_PER_HOUR = "batches_per_hour"
NOT_BEFORE = "not_before"
LIMIT_NAMES = (ENQUEUED_TOKENS, QUEUED_REQUESTS, BATCHES_PER_HOUR)
"""The limits a job file may set and a provider may teach; `not_before` is a wait, not a limit."""

ALL_MODELS = "*"
"""The model key of a limit shared by all of a provider's models (Anthropic's queue)."""


@dataclass(frozen=True)
class QueueLimits:
    """What the account allows; None where unknown or unlimited."""

    enqueued_tokens: float | None = None
    """Infinite when the account is known to have no such limit (lowtide's emulator says so)."""
    queued_requests: float | None = None
    batches_per_hour: float | None = None
    not_before: float | None = None
    """Epoch second before which no batch may be created (a 429's `retry-after`)."""


@dataclass(frozen=True)
class QueueUsage:
    """What lowtide has at the provider now, across every run of the state file."""

    tokens: int = 0
    """Estimated prompt tokens of the model's unfinished batches."""
    requests: int = 0
    """Requests of the provider's unfinished batches, all models."""
    unadmitted: int = 0
    """The model's batches created but not yet admitted (still validating)."""
    creates_last_hour: int = 0


@dataclass(frozen=True)
class Batch:
    """The size of the batch about to be created."""

    tokens: int
    requests: int


def room_for(
    batch: Batch,
    limits: QueueLimits,
    usage: QueueUsage,
    *,
    now: float,
    probe: bool,
) -> str | None:
    """None when `batch` may be created now, else why not (one line for the progress display).

    A batch larger than the whole queue is let through when nothing else is in flight: waiting
    could never make room for it, and the provider's answer then says what to do."""
    if limits.not_before is not None and now < limits.not_before:
        return f"the provider asked to wait {math.ceil(limits.not_before - now)} s"
    if limits.batches_per_hour is not None and usage.creates_last_hour >= limits.batches_per_hour:
        return f"{usage.creates_last_hour} batches created in the last hour (the limit)"
    tokens = limits.enqueued_tokens
    if tokens is not None:
        room = tokens * PLANNING_SHARE - usage.tokens
        if batch.tokens > room and usage.tokens > 0:
            return f"queue holds {usage.tokens:,} of {tokens:,.0f} enqueued tokens"
    elif probe and usage.unadmitted:
        return "waiting for the last batch to be admitted (the token limit is not known yet)"
    requests = limits.queued_requests
    if requests is not None and batch.requests > requests - usage.requests and usage.requests > 0:
        return f"queue holds {usage.requests:,} of {requests:,.0f} requests"
    return None


def limits_from(values: dict[str, float]) -> QueueLimits:
    """QueueLimits from name → value pairs (unknown names ignored, NaN dropped; infinity is a
    limit known to be absent, which is not the same as unknown)."""

    def pick(name: str) -> float | None:
        value = values.get(name)
        return None if value is None or math.isnan(value) else value

    return QueueLimits(
        enqueued_tokens=pick(ENQUEUED_TOKENS),
        queued_requests=pick(QUEUED_REQUESTS),
        batches_per_hour=pick(BATCHES_PER_HOUR),
        not_before=pick(NOT_BEFORE),
    )
