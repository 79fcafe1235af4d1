"""Prometheus text and JSON views of a simulated engine's `EngineStats`: `render_metrics` is
what the emulated server's `GET /metrics` returns, under vLLM's metric names and with its
`model_name`/`engine` labels, and `stats_dict` is the `GET /_emulator/stats` snapshot that
benches and tests read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lowtide.emulator.engine_capacity import EngineConfig
from lowtide.emulator.engine_reports import FINISH_REASONS, EngineStats, Histogram


def _histogram_lines(name: str, hist: Histogram, labels: str) -> list[str]:
    lines = [
        f"# HELP {name} Histogram of {name[5:]} (simulated seconds).",
        f"# TYPE {name} histogram",
    ]
    for le, count in hist.cumulative():
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {count}')
    lines.append(f"{name}_sum{{{labels}}} {hist.sum!r}")
    lines.append(f"{name}_count{{{labels}}} {hist.count}")
    return lines


def render_metrics(stats: EngineStats, labels: str) -> str:
    """Prometheus text exposition of `stats` under vLLM's metric names."""
    lines: list[str] = []

    def gauge(name: str, help_text: str, value: float) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} gauge"))
        lines.append(f"{name}{{{labels}}} {float(value)!r}")

    def counter(name: str, help_text: str, value: float) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} counter"))
        lines.append(f"{name}_total{{{labels}}} {float(value)!r}")

    gauge(
        "vllm:num_requests_running", "Number of requests in model execution batches.", stats.running
    )
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
    counter("vllm:num_preemptions", "Cumulative number of preemptions.", stats.preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total)
    counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        stats.generation_tokens_total,
    )
    counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries,
    )
    counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits,
    )
    name = "vllm:request_success"
    lines.extend(
        (f"# HELP {name} Count of successfully processed requests.", f"# TYPE {name} counter")
    )
    reasons = list(FINISH_REASONS) + [r for r in stats.request_success if r not in FINISH_REASONS]
    for reason in reasons:
        value = float(stats.request_success.get(reason, 0))
        lines.append(f'{name}_total{{{labels},finished_reason="{reason}"}} {value!r}')
    lines.extend(_histogram_lines("vllm:time_to_first_token_seconds", stats.ttft, labels))
    lines.extend(_histogram_lines("vllm:e2e_request_latency_seconds", stats.e2e_latency, labels))
    lines.extend(_histogram_lines("vllm:request_queue_time_seconds", stats.queue_time, labels))
    return "\n".join(lines) + "\n"


def stats_dict(stats: EngineStats, config: EngineConfig) -> dict[str, Any]:
    """JSON-ready engine snapshot plus its config (for benches and tests)."""
    data = {
        f.name: getattr(stats, f.name)
        for f in dataclasses.fields(stats)
        if not isinstance(getattr(stats, f.name), Histogram)
    }
    cfg = dataclasses.asdict(config)
    if math.isinf(cfg["time_scale"]):
        cfg["time_scale"] = "inf"
    data["config"] = cfg
    return data
