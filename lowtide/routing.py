"""`[route]`: one job over an ordered list of engines, switching when a step's time is up.

A route is a chain of runs, one per step, each on its own backend. Step 0 starts on the first
engine; when its time is up (`switch_after_hours` of that step, or the route's `deadline`)
`flows/route.py` cancels what it has in flight and opens the next step over the rows still
unanswered. Answers any engine of the route gave are reused by every step (`tasks/dedupe.py`),
so nothing is asked twice on purpose. Past the deadline every remaining step but the last is
skipped. The last step has no end: put a fast engine there (a realtime API or the pool).

Times are wall-clock UTC, read through `clock()` so tests can move it.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lowtide.backends import REGISTRY


def clock() -> datetime:
    """Now, naive UTC (as the store keeps timestamps). Tests replace it to move time."""
    return datetime.fromtimestamp(time.time(), UTC).replace(tzinfo=None)


class RouteSpec(BaseModel):
    """`[route] engines = ["anthropic", "openai", "vllm"]`, `deadline` (an ISO 8601 time or
    hours from the route's start), `switch_after_hours` (one per step but the last)."""

    model_config = ConfigDict(extra="forbid")

    engines: list[str] = Field(min_length=2)
    deadline: datetime | float | None = None
    switch_after_hours: list[float] = Field(default_factory=list)

    @field_validator("engines")
    @classmethod
    def _known_engines(cls, v: list[str]) -> list[str]:
        unknown = [e for e in v if e not in REGISTRY]
        if unknown:
            raise ValueError(f"unknown engine(s) {unknown}; known: {', '.join(REGISTRY)}")
        if len(set(v)) != len(v):
            raise ValueError("an engine may appear once in a route")
        shards = [e for e in v if REGISTRY[e].shard_files]
        if shards:
            raise ValueError(
                f"{shards} run as shards in a Job lowtide cannot stop, so a route cannot switch "
                "away from them; run them on their own (--backend)"
            )
        uncut = [e for e in v[:-1] if REGISTRY[e].mode != "batch"]
        if uncut:
            raise ValueError(
                f"{uncut} answer as they go and cannot be cut short at a step's end: put such an "
                "engine last"
            )
        return v

    @field_validator("deadline", mode="before")
    @classmethod
    def _deadline_type(cls, v: object) -> object:
        # a quoted "8" would otherwise be read as a time (1970-01-01T00:00:08)
        if isinstance(v, bool) or (isinstance(v, str) and _is_number(v)):
            raise ValueError("give hours as a number without quotes (deadline = 8)")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("hours must be a finite number")
        return v

    @field_validator("switch_after_hours")
    @classmethod
    def _non_negative(cls, v: list[float]) -> list[float]:
        if any(not math.isfinite(h) or h < 0 for h in v):
            raise ValueError("hours may not be negative (or infinite)")
        return v

    @field_validator("deadline")
    @classmethod
    def _deadline_form(cls, v: datetime | float | None) -> datetime | float | None:
        if isinstance(v, datetime) and v.tzinfo is None:
            raise ValueError(
                "give the deadline's time zone (e.g. 2026-12-01T06:00:00Z) or hours from the "
                "start (deadline = 8)"
            )
        if isinstance(v, float | int) and not isinstance(v, datetime) and v <= 0:
            raise ValueError("hours from the start must be above 0")
        return v

    @model_validator(mode="after")
    def _switches_fit(self) -> RouteSpec:
        if len(self.switch_after_hours) > len(self.engines) - 1:
            raise ValueError(
                f"switch_after_hours has {len(self.switch_after_hours)} entries for "
                f"{len(self.engines)} engines: give one per step but the last"
            )
        if self.deadline is None and not self.switch_after_hours:
            raise ValueError("a route needs a deadline or switch_after_hours, or it never switches")
        return self

    def deadline_at(self, route_started: datetime) -> datetime | None:
        """The route's deadline as naive UTC, for a route that started at `route_started`."""
        if self.deadline is None:
            return None
        if isinstance(self.deadline, datetime):
            return self.deadline.astimezone(UTC).replace(tzinfo=None)
        return route_started + timedelta(hours=float(self.deadline))

    def step_ends_at(
        self, step: int, step_started: datetime, route_started: datetime
    ) -> datetime | None:
        """When step `step` (started at `step_started`) gives way to the next; None for the last
        step, which runs to its end."""
        if step >= len(self.engines) - 1:
            return None
        ends = [self.deadline_at(route_started)]
        if step < len(self.switch_after_hours):
            ends.append(step_started + timedelta(hours=self.switch_after_hours[step]))
        known = [e for e in ends if e is not None]
        return min(known) if known else None

    def next_step(self, step: int, at: datetime, route_started: datetime) -> int:
        """The step after `step` when switching at `at`: past the deadline, straight to the last."""
        deadline = self.deadline_at(route_started)
        if deadline is not None and at >= deadline:
            return len(self.engines) - 1
        return step + 1


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def is_due(ends_at: datetime | None) -> bool:
    """Whether a step that ends at `ends_at` should give way now."""
    return ends_at is not None and clock() >= ends_at


def seconds_left(ends_at: datetime | None) -> float | None:
    """Seconds until `ends_at` (never below 0), None when the step has no end."""
    if ends_at is None:
        return None
    return max((ends_at - clock()).total_seconds(), 0.0)
