"""Beyond one machine: `vllm run-batch` shards, written from and read back into lowtide's rows."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from lowtide.backends.vllm_pool.control import request_weights, send_order


def write_run_batch_shards(
    requests: pl.DataFrame, out_dir: str | Path, shards: int, *, bucketing: bool = True
) -> list[Path]:
    """Write the stored request lines as `shard-<i>.jsonl` files for `vllm run-batch -i`
    (the lines are already its input format). Requests are dealt round-robin in sending order
    (longest first with `bucketing`), so every shard gets a like mix of lengths and the same
    work. Returns the paths, index order; empty shards are not written."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = requests["line"].to_list()
    order = send_order(request_weights(requests), bucketing)
    paths = []
    for k in range(shards):
        part = [lines[i] for i in order[k::shards]]
        if not part:
            break
        path = out / f"shard-{k}.jsonl"
        path.write_text("\n".join(part) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


ENGINE_HOUR_S = 3600
DEFAULT_TOKENS_PER_S = 2500.0
"""Output tokens per second of one engine when [pool] tokens_per_s is unset: an 8B model on
one H100-class GPU with run-batch's engine flags set (measure yours: `lowtide plan` says how)."""
PREFILL_SPEEDUP = 10
"""How many prompt tokens an engine reads in the time it writes one output token (prefill is
batched and far cheaper per token than decode); only the order of magnitude matters here."""


def request_work(est_input_tokens: Sequence[int | None], expected_output_tokens: int) -> list[int]:
    """Engine work per request in output-token equivalents: its expected output plus its
    prompt at PREFILL_SPEEDUP prompt tokens per output token (an unknown prompt counts 0)."""
    return [expected_output_tokens + (t or 0) // PREFILL_SPEEDUP for t in est_input_tokens]


def plan_shards(
    work: Sequence[int],
    *,
    budget: float,
    max_requests: int | None = None,
    shards: int | None = None,
) -> list[list[int]]:
    """Request indices per run-batch shard, shard index order.

    The count is `shards` when given (never more than the requests), else the fewest shards
    whose mean work fits `budget` (one engine-hour of tokens) and that hold at most
    `max_requests` each. Requests are dealt round-robin, heaviest first, so every shard gets a
    like mix and about the same work: a shard holds at most ceil(n / count) requests, and its
    work exceeds the mean by less than one request's. Every index appears exactly once; no
    shard is empty."""
    n = len(work)
    if n == 0:
        return []
    if shards is not None:
        if shards < 1:
            raise ValueError("shards must be at least 1")
        count = min(shards, n)
    else:
        if budget <= 0:
            raise ValueError("budget must be positive")
        count = max(1, math.ceil(sum(work) / budget))
        if max_requests is not None:
            if max_requests < 1:
                raise ValueError("max_requests must be at least 1")
            count = max(count, math.ceil(n / max_requests))
        count = min(count, n)
    order = sorted(range(n), key=lambda i: -work[i])
    return [order[k::count] for k in range(count)]


def run_batch_results(content: bytes) -> pl.DataFrame:
    """A `vllm run-batch` output file → RESULT_SCHEMA rows.

    run-batch writes OpenAI batch output lines, except that a failed request's `error` is
    either a string or vLLM's error envelope `{"error": {message, type, param, code}}` rather
    than OpenAI's `{code, message}` (provider-apis.md §3.2). `openai_batch.parse_result_lines`
    reads both shapes (code = the envelope's type, or `run_batch_error` for a string), so this
    is that reader under the name a run-batch caller looks for. A run killed midway leaves a
    valid prefix: what is missing is simply not in the frame."""
    # Imported on use: the pool itself never needs the openai SDK that module loads.
    from lowtide.backends.openai_batch import parse_result_lines

    return parse_result_lines(content)
