"""What one `run_pool` did: counts, tokens, time-weighted concurrency, per endpoint and in all."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EndpointStats:
    url: str
    sent: int = 0
    answered: int = 0
    errors: int = 0
    failovers: int = 0  # times this endpoint was marked down
    requeued: int = 0  # requests sent here that went back to the queue
    drains: int = 0  # times its address left `[pool] discover` (it was drained)
    drained_after: int | None = None  # `sent` when it was last drained; None while it serves
    mean_inflight: float = 0.0
    cap_history: list[tuple[float, int]] = field(default_factory=list)  # (seconds, cap)

    @property
    def cap_max(self) -> int:
        return max((c for _, c in self.cap_history), default=0)

    @property
    def cap_final(self) -> int:
        return self.cap_history[-1][1] if self.cap_history else 0


@dataclass
class PoolStats:
    """What one `run_pool` did. `answered + errors == requests` when it returns normally."""

    requests: int = 0
    answered: int = 0
    errors: int = 0
    failovers: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    mean_inflight: float = 0.0  # over the whole pool, time-weighted
    checkpoints: int = 0
    resent: list[str] = field(default_factory=list)  # sent again after a send with no answer
    per_endpoint: dict[str, EndpointStats] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def gpu_cost_usd(self, gpu_hour_usd: float, gpus: int) -> float:
        """What the run cost at `gpu_hour_usd` per GPU for `gpus` GPUs held for its wall time
        ([pool] gpu_hour_usd and gpus)."""
        return self.wall_s / 3600.0 * gpu_hour_usd * gpus

    def summary(self) -> dict[str, Any]:
        """Plain numbers for artifacts and logs."""
        return {
            "requests": self.requests,
            "answered": self.answered,
            "errors": self.errors,
            "failovers": self.failovers,
            "retries": self.retries,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "mean_inflight": round(self.mean_inflight, 1),
            "per_endpoint": {
                url: {
                    "sent": e.sent,
                    "answered": e.answered,
                    "errors": e.errors,
                    "failovers": e.failovers,
                    "drains": e.drains,
                    "mean_inflight": round(e.mean_inflight, 1),
                    "cap_max": e.cap_max,
                }
                for url, e in self.per_endpoint.items()
            },
        }


class InflightMeter:
    """A count of requests in flight and the area under it over time, for time-weighted means.

    Times are passed in (monotonic seconds), so the meter itself never reads a clock."""

    __slots__ = ("area", "count", "last", "since")

    def __init__(self, since: float):
        self.since = since
        self.last = since
        self.count = 0
        self.area = 0.0

    def add(self, now: float, delta: int) -> None:
        """`delta` requests started (positive) or ended (negative) at `now`."""
        self.area += self.count * (now - self.last)
        self.last = now
        self.count += delta

    def mean(self, now: float) -> float:
        """The time-weighted mean count from `since` to `now`; 0 over an empty interval."""
        wall = now - self.since
        area = self.area + self.count * (now - self.last)
        return area / wall if wall > 0 else 0.0
