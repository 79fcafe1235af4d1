"""Account-level limits of the emulated providers, and how full their queues ran.

- OpenAI enqueued tokens: a batch's prompt tokens sit in its model's pool from admission
  (validation end) until it reaches a terminal status. The admission itself is decided in
  `openai_batch_lifecycle` on the simulated timeline; `enqueued_tokens` sums the pool.
- OpenAI batch creates: at most `batch_creates_per_hour` accepted creates in any simulated hour
  (a sliding window), else 429.
- Anthropic processing queue: requests of batches whose processing_status is `in_progress`,
  all models together, at most `anthropic_queue_limit`, else 429 and nothing is created.
- Retry hints: both 429s say when room frees up, converted from simulated to real time.
- The queue report behind `GET /_emulator/queue`: per queue, how much of its limit the work
  used while it lasted, measured since `QueueMarks.since` (`POST /_emulator/queue/reset`).

Everything here is derived from the batch records (their create, admission and end times), so
it survives a restart with them; only `QueueMarks` is state of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lowtide.emulator.faults import ApiError

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

RATE_WINDOW_S = 3600.0


@dataclass
class QueueMarks:
    """Where the current queue measurement began, and what no batch record remembers."""

    since: float  # simulated time of the last reset (or of the emulator's first start)
    since_seq: int  # the first creation sequence number that belongs to the measurement
    anthropic_refusals: int = 0  # queue-limit 429s since the reset (they create nothing)


def retry_headers(simulated_wait_s: float, time_scale: float) -> dict[str, str]:
    """`retry-after-ms` / `retry-after` for a wait of `simulated_wait_s` on the emulator's clock.

    A client sleeps in real time, so the wait is divided by `time_scale`; a frozen clock
    (`time_scale` 0, tests advance it by hand) has no real rate, and the simulated value is sent
    as it is. Milliseconds and whole seconds are rounded up, at least 1 each."""
    real = simulated_wait_s / time_scale if time_scale > 0 else simulated_wait_s
    # round() first so that float noise (0.1 * 1000 = 100.00000000000001) does not add a unit
    millis = max(1, math.ceil(round(real * 1000, 6)))
    return {"retry-after-ms": str(millis), "retry-after": str(max(1, math.ceil(millis / 1000)))}


def wait_until_fits(
    held: Iterable[tuple[float, int]], now: float, need: int, limit: int
) -> float | None:
    """Simulated seconds from `now` until `need` more fit under `limit`, when what is held now
    is released as `(release time, amount)` says; None when `need` alone is over the limit."""
    if need > limit:
        return None
    releases = sorted(held)
    total = sum(amount for _, amount in releases)
    free_at = now
    for release, amount in releases:
        if total + need <= limit:
            break
        total -= amount
        free_at = release
    return max(0.0, free_at - now)


def check_batch_create_rate(state: EmulatorState, now: float) -> None:
    """ApiError(429) when `batch_creates_per_hour` creates were accepted in the last simulated
    hour; its retry hint is when the oldest of them leaves the window. (Either 429 for a request
    that can never fit, a limit of 0 or a batch bigger than the queue, has no hint but
    `x-should-retry: false`: waiting never helps.)"""
    limit = state.config.batch_creates_per_hour
    if limit is None:
        return
    recent: list[float] = []
    for batch in reversed(state.batches.values()):  # creation order, so newest first
        if batch.created_at <= now - RATE_WINDOW_S:
            break
        recent.append(batch.created_at)
    if len(recent) < limit:
        return
    wait = wait_until_fits(((c + RATE_WINDOW_S, 1) for c in recent), now, 1, limit)
    headers = _retry_hint(state, wait)
    raise ApiError(
        429,
        f"Rate limit reached for batch creation in organization emulator: limit {limit} "
        f"batches per hour, {len(recent)} created in the last hour. {_try_again(headers)}",
        type="requests",
        code="rate_limit_exceeded",
        headers=headers,
    )


def check_anthropic_queue(state: EmulatorState, now: float, need: int) -> None:
    """ApiError(429) when `need` more requests would overfill Anthropic's processing queue; the
    refusal is counted for the queue report. Its retry hint is when enough in_progress batches
    will have ended (cancels aside)."""
    limit = state.config.anthropic_queue_limit
    if limit is None:
        return
    running = [b for b in state.message_batches.values() if b.status == "in_progress"]
    queued = sum(len(b.requests) for b in running)
    if queued + need <= limit:
        return
    state.queue_marks.anthropic_refusals += 1
    state.mark_changed()  # a 429 is not persisted on its own; the count must be
    wait = wait_until_fits(((b.natural_end(), len(b.requests)) for b in running), now, need, limit)
    headers = _retry_hint(state, wait)
    raise ApiError(
        429,
        f"Message batch queue limit reached: {queued} requests are waiting to be processed "
        f"and this batch adds {need}, over the limit of {limit} for your organization. "
        f"{_try_again(headers)}",
        headers=headers,
    )


def _retry_hint(state: EmulatorState, wait: float | None) -> dict[str, str]:
    """Retry headers for a simulated `wait`; None (it never fits) tells the SDKs not to retry."""
    if wait is None:
        return {"x-should-retry": "false"}
    return retry_headers(wait, state.clock.time_scale)


def _try_again(headers: dict[str, str]) -> str:
    if "retry-after-ms" not in headers:
        return "The request alone is over the limit; retrying will not help."
    return f"Please try again in {int(headers['retry-after-ms']) / 1000:g}s."


def enqueued_tokens(state: EmulatorState, model: str | None) -> int:
    """Prompt tokens of `model` held now: admitted OpenAI batches not yet terminal."""
    return sum(
        batch.queue_tokens()
        for batch in state.batches.values()
        if batch.model == model and "in_progress" in batch.times and batch.ended_at() is None
    )


# --------------------------------------------------------------------------- the report


@dataclass
class _Meter:
    """One queue's numbers over the measurement: creates, refusals, the span work lasted and
    the integral of what it held."""

    limit: int | None
    creates: int = 0
    refusals: int = 0
    first: float = math.inf
    last: float = -math.inf
    last_create: float = -math.inf
    occupied: float = 0.0
    held: list[tuple[float, float, int]] = field(default_factory=list)
    """(from, to, amount) of each batch's hold, to measure it up to the last create too."""

    def add(
        self,
        marks: QueueMarks,
        now: float,
        *,
        seq: int,
        life: tuple[float, float | None],
        held: tuple[float, float | None] | None,
        amount: int,
    ) -> bool:
        """Count a batch alive from `life[0]` to `life[1]` (None: still), holding `amount`
        over `held`; False for a batch over before the measurement began (not counted)."""
        created, ended = life
        new = seq >= marks.since_seq
        if not new and ended is not None and ended <= marks.since:
            return False
        self.creates += new
        self.first = min(self.first, max(created, marks.since))
        self.last = max(self.last, now if ended is None else ended)
        if new:
            self.last_create = max(self.last_create, created)
        if held is not None:
            start, stop = held
            stop = now if stop is None else min(stop, now)
            start = max(start, marks.since)
            self.occupied += amount * max(0.0, stop - start)
            self.held.append((start, stop, amount))
        return True

    def to_json(self) -> dict[str, Any]:
        busy = max(0.0, self.last - self.first) if self.first < math.inf else 0.0
        share = self.occupied / (self.limit * busy) if self.limit and busy > 0 else None
        # while work was still being sent: up to the last create (after it, nothing was left
        # to fill the queue with, and it drains)
        sending = max(0.0, self.last_create - self.first) if self.first < math.inf else 0.0
        until = self.first + sending
        filled = sum(n * max(0.0, min(b, until) - a) for a, b, n in self.held)
        while_sending = filled / (self.limit * sending) if self.limit and sending > 0 else None
        return {
            "limit": self.limit,
            "refusals": self.refusals,
            "creates": self.creates,
            "busy_s": busy,
            "occupied": self.occupied,
            "share": share,
            "sending_s": sending,
            "share_while_sending": while_sending,
        }


def queue_report(state: EmulatorState, now: float) -> dict[str, Any]:
    """`GET /_emulator/queue`: OpenAI per model with a batch in the measurement (tokens),
    Anthropic as one queue (requests). Call it under the state's lock after a tick, so every
    status is current."""
    marks = state.queue_marks
    openai: dict[str, _Meter] = {}
    for batch in state.batches.values():
        if batch.model is None:  # an unreadable or empty file names no model, holds nothing
            continue
        meter = openai.setdefault(batch.model, _Meter(state.config.enqueued_token_limit))
        admitted = batch.times.get("in_progress")
        counted = meter.add(
            marks,
            now,
            seq=batch.seq,
            life=(batch.created_at, batch.ended_at()),
            held=None if admitted is None else (admitted, batch.ended_at()),
            amount=0 if admitted is None else batch.queue_tokens(),
        )
        meter.refusals += counted and batch.refused_for_tokens()
    anthropic = _Meter(state.config.anthropic_queue_limit, refusals=marks.anthropic_refusals)
    for mbatch in state.message_batches.values():
        anthropic.add(
            marks,
            now,
            seq=mbatch.seq,
            life=(mbatch.created_at, mbatch.ended_at),
            held=(mbatch.created_at, mbatch.queued_until()),
            amount=len(mbatch.requests),
        )
    return {
        "openai": {m: meter.to_json() for m, meter in openai.items() if meter.first < math.inf},
        "anthropic": {"*": anthropic.to_json()},
    }
