"""Beyond one machine: `vllm run-batch` shards, written from and read back into lowtide's rows."""

from __future__ import annotations

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
