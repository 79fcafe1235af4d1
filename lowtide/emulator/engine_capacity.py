"""The numbers that define a simulated engine and the pure maths on them: `EngineConfig`
(slots, token budget, KV cache size, prefill and decode speeds, time scale), the `Workload`
shape, `capacity()` (the throughput ceiling the scheduler in `engine` can reach for a workload,
and which constraint sets it) and `prefix_block_hashes()` (how a prompt's KV blocks are named
for prefix caching). No asyncio and no state: benches and tests compute ceilings from here
without starting an engine. The timing model itself is described in `engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineConfig:
    """Shape and speed of one simulated engine. Durations are simulated seconds."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int = 200_000
    max_model_len: int = 32_768
    prefill_tokens_per_s: float = 20_000.0
    decode_step_s_base: float = 0.012
    decode_step_s_per_seq: float = 0.00015
    prefix_cache: bool = True
    block_size: int = 16
    # Waiting requests beyond this are refused (vLLM `--max-num-queued-reqs`); None = unbounded.
    max_num_queued_reqs: int | None = None
    # Simulated seconds per wall-clock second; math.inf = virtual time (never sleep).
    time_scale: float = 1.0
    # Wall seconds the engine may run behind its schedule (GC, a busy CPU) before it stops
    # trying to catch up; lost time is dropped, so the engine never runs above its rate.
    max_lag_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be at least 1")
        for name in ("prefill_tokens_per_s", "time_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EngineConfig.{name} must be positive")
        if self.decode_step_s_base < 0 or self.decode_step_s_per_seq < 0:
            raise ValueError("EngineConfig decode step times must not be negative")
        if self.decode_step_s_base + self.decode_step_s_per_seq <= 0:
            raise ValueError("EngineConfig: a decode step must take some time")
        if self.kv_cache_tokens < self.max_model_len + self.block_size:
            raise ValueError(
                f"EngineConfig: kv_cache_tokens={self.kv_cache_tokens} cannot hold one request "
                f"of max_model_len={self.max_model_len}; raise kv_cache_tokens or lower "
                "max_model_len (vLLM refuses to start in this case too)"
            )

    @property
    def kv_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    def step_seconds(self, n_seqs: int, prefill_tokens: int) -> float:
        """Simulated duration of one step in which `n_seqs` sequences emit a token and
        `prefill_tokens` prompt tokens are computed."""
        return (
            self.decode_step_s_base
            + self.decode_step_s_per_seq * n_seqs
            + prefill_tokens / self.prefill_tokens_per_s
        )


@dataclass(frozen=True)
class Workload:
    """Mean request shape: prompt tokens, output tokens, and the share of prompt tokens that
    a warm prefix cache serves (0..1)."""

    prompt_tokens: float
    output_tokens: float
    prefix_share: float = 0.0


@dataclass(frozen=True)
class Capacity:
    """The ceiling of an engine fed without pause by a given workload.

    `output_tokens_per_s` and `requests_per_s` are per wall-clock second (the simulated rate
    times `time_scale`). `batch` is the mean number of sequences emitting a token per step at
    the ceiling and `limited_by` names the constraint that sets it."""

    output_tokens_per_s: float
    requests_per_s: float
    batch: float
    limited_by: Literal["max_num_seqs", "kv_cache", "token_budget"]


def capacity(config: EngineConfig, workload: Workload) -> Capacity:
    """Ceiling throughput for `workload`, derived from `EngineConfig.step_seconds`.

    With `d` sequences emitting a token per step, a request of P prompt tokens (of which a
    share s is served by the prefix cache) and O output tokens costs O steps of which it pays
    1/d of the fixed part each, O per-sequence shares, and its own prefill:

        cost = O * (base / d + per_seq) + P * (1 - s) / prefill_tokens_per_s

    so the ceiling is O / cost output tokens per simulated second. `d` is the smallest of
    `max_num_seqs`, the sequences the KV cache holds on average (each holds its uncached prompt
    and half its output; the shared prefix is held once) and the sequences the token budget
    feeds (each step's d decode tokens plus d * P(1-s)/O prefill tokens must fit the budget).
    Preemption, queueing gaps and HTTP time only lower what is reached, so a client's measured
    throughput over this is its efficiency.
    """
    prompt = max(float(workload.prompt_tokens), 0.0)
    out = max(float(workload.output_tokens), 1.0)
    share = min(max(workload.prefix_share, 0.0), 1.0) if config.prefix_cache else 0.0
    fresh = prompt * (1.0 - share)
    by_seqs = float(config.max_num_seqs)
    by_kv = max(config.kv_cache_tokens - prompt * share, 1.0) / max(fresh + out / 2.0, 1.0)
    by_budget = config.max_num_batched_tokens * out / (out + fresh)
    limits = {"max_num_seqs": by_seqs, "kv_cache": by_kv, "token_budget": by_budget}
    limited_by = min(limits, key=lambda k: limits[k])
    d = max(limits[limited_by], 1.0)
    cost = out * (config.decode_step_s_base / d + config.decode_step_s_per_seq)
    cost += fresh / config.prefill_tokens_per_s
    requests = config.time_scale / cost
    return Capacity(
        output_tokens_per_s=requests * out,
        requests_per_s=requests,
        batch=d,
        limited_by=limited_by,  # type: ignore[arg-type]
    )


def capacity_tokens_per_s(config: EngineConfig, workload: Workload) -> float:
    """Ceiling in **output** tokens per wall-clock second; see `capacity`."""
    return capacity(config, workload).output_tokens_per_s


def prefix_block_hashes(token_ids: Sequence[int], block_size: int = 16) -> tuple[int, ...]:
    """Chained hashes of the full `block_size`-token blocks of a prompt: block i's hash covers
    blocks 0..i, so two prompts share hash i exactly when their first (i+1)*block_size tokens
    are equal. A trailing partial block gets no hash (it is never cached)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return tuple(hashes)
