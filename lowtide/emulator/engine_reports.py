"""What a simulated engine reports to its callers: a finished request's `GenerationResult`,
the errors a refused or lost request raises instead, and `EngineStats`, the snapshot of gauges,
counters and Prometheus-style latency histograms (vLLM's bucket edges and finish reasons).
Plain records: the scheduler in `engine` fills them and `vllm_metrics` renders them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's bucket edges (v1/metrics/loggers.py) for the three latency histograms exposed.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class EngineDeadError(RuntimeError):
    """The engine was killed; pending and new requests fail with this."""


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_num_queued_reqs`; the server answers 503."""


class RequestTooLongError(ValueError):
    """Prompt plus output would exceed `max_model_len`; the server answers 400."""

    def __init__(self, message: str, *, prompt_tokens: int, output_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.limit = limit


class Histogram:
    """Cumulative-bucket histogram in Prometheus's sense (buckets, sum, count)."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, ending with ("+Inf", count)."""
        out, total = [], 0
        for edge, n in zip((*self.buckets, math.inf), self.counts, strict=True):
            total += n
            out.append(("+Inf" if edge == math.inf else repr(float(edge)), total))
        return out


@dataclass(frozen=True)
class GenerationResult:
    """What the engine reports for one finished request; times are simulated seconds."""

    output_tokens: int
    finish_reason: str
    cached_tokens: int
    queue_s: float
    ttft_s: float
    e2e_s: float
    preemptions: int


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters.

    `sim_seconds` is simulated busy time (steps run); `running_seq_seconds` and
    `waiting_seq_seconds` integrate the gauges over it, so their ratio to `sim_seconds` over an
    interval is the mean number running or waiting. `prefill_tokens_computed` excludes tokens
    served by the prefix cache and `prefill_seconds` is the step time spent on them."""

    alive: bool
    running: int
    waiting: int
    kv_usage: float
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefill_tokens_computed: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    request_success: dict[str, int]
    steps: int
    sim_seconds: float
    prefill_seconds: float
    running_seq_seconds: float
    waiting_seq_seconds: float
    ttft: Histogram = field(repr=False)
    e2e_latency: Histogram = field(repr=False)
    queue_time: Histogram = field(repr=False)
