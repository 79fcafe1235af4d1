"""assemble: unique requests → batch JSONL lines with a fixed prefix, cut into shards.

Every line shares the same system prompt and few-shot messages, in the same order, before the
unit's own message, so provider prompt caching and vLLM prefix caching apply. Shards are cut at
the backend's request and byte limits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import orjson
import polars as pl

from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.errors import BudgetExceededError
from lowtide.jobspec import JobSpec
from lowtide.orchestration import task
from lowtide.request_lines import json_string
from lowtide.runlog import stage_log
from lowtide.slices import by_slices
from lowtide.tokens import count_tokens

BATCH_ROW_SCHEMA = {
    "batch_id": pl.String,
    "shard": pl.Int32,
    "attempt": pl.Int32,
    "backend": pl.String,
    "n_requests": pl.Int32,
    "n_bytes": pl.Int64,
    "est_tokens": pl.Int64,
}
"""The columns of a batch row in a write-ahead manifest."""

_SENTINEL = "\x00lowtide-user-message\x00"
_ESTIMATE_SAMPLE = 2_000
_SLICE_ROWS = 50_000


def fixed_messages(job: JobSpec) -> list[dict[str, str]]:
    msgs: list[dict[str, str]] = []
    if job.prompt.system:
        msgs.append({"role": "system", "content": job.prompt.system})
    for ex in job.prompt.examples:
        msgs.append({"role": "user", "content": ex.user})
        msgs.append({"role": "assistant", "content": ex.assistant})
    return msgs


def chat_body(job: JobSpec, user: str) -> dict:
    """The chat-completions body for one user message (extra_body keys are passed verbatim)."""
    body = {
        "model": job.model.name,
        "messages": [*fixed_messages(job), {"role": "user", "content": user}],
        "temperature": job.model.temperature,
        "max_tokens": job.model.max_tokens,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": job.output.name, "strict": True, "schema": job.output_schema},
        },
    }
    body.update(job.model.extra_body)
    return body


def line_template(job: JobSpec) -> tuple[str, str, str]:
    """(head, mid, tail): a request line is head + "custom_id" + mid + "user message" + tail,
    with both values as JSON strings. The parts are the same for every request of a prompt, so
    the store keeps them once and each request keeps only its own message."""
    line = orjson.dumps(
        {
            "custom_id": _SENTINEL,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat_body(job, _SENTINEL),
        }
    ).decode()
    head, mid, tail = line.split(orjson.dumps(_SENTINEL).decode())
    return head, mid, tail


def template_id(job: JobSpec) -> str:
    return f"openai_chat-{job.prompt_fingerprint()[:24]}"


def openai_lines(job: JobSpec, requests: pl.DataFrame) -> pl.Series:
    """The full OpenAI batch line of each request (for tests and small sets; the store builds
    lines per shard from the template, so a million lines are never held at once)."""
    head, mid, tail = line_template(job)
    return requests.select(
        pl.concat_str(
            [
                pl.lit(head + '"'),
                pl.col("custom_id"),
                pl.lit('"' + mid),
                json_string("user"),
                pl.lit(tail),
            ]
        ).alias("line")
    )["line"]


def _line_bytes_expr(job: JobSpec) -> pl.Expr:
    head, mid, tail = line_template(job)
    fixed = len((head + mid + tail).encode()) + 2
    return pl.col("custom_id").str.len_bytes() + json_string("user").str.len_bytes() + fixed


def line_bytes(job: JobSpec, requests: pl.DataFrame) -> pl.Series:
    """Size of each request's line in bytes, without building the lines."""
    size = _line_bytes_expr(job).alias("bytes")
    # the escaped messages are a copy of every text, held only to be measured
    return by_slices(requests, _SLICE_ROWS, lambda part: part.select(size)["bytes"])


def _estimate_expr(job: JobSpec, sample: pl.Series, exact: bool = False) -> pl.Expr:
    """The token estimate of `user`: the fixed prefix counted once, the message from the
    counted `sample`'s tokens-per-byte ratio. With `exact`, a unit whose tokens chunking
    counted (`unit_tokens`: a cut piece of a long text) is that count plus the template's own
    words: long texts are where a sample's ratio is furthest off, and a provider's queue is
    planned by these numbers (lowtide/quota.py)."""
    prefix = sum(count_tokens(m["content"]) + 4 for m in fixed_messages(job)) + 3
    texts = sample.to_list()
    sample_bytes = sum(len(s.encode()) for s in texts) or 1
    ratio = sum(count_tokens(s) for s in texts) / sample_bytes
    est_user = (pl.col("user").str.len_bytes() * ratio).round().cast(pl.Int64) + 4
    if exact:
        template = job.prompt.user_template
        fields = job.prompt.template_fields()
        words = count_tokens(template.format(**dict.fromkeys(fields, ""))) + 2 * len(fields)
        counted = pl.col("unit_tokens").cast(pl.Int64) + words + 4
        est_user = pl.when(pl.col("unit_tokens").is_not_null()).then(counted).otherwise(est_user)
    return pl.lit(prefix) + est_user


def estimate_input_tokens(job: JobSpec, requests: pl.DataFrame) -> pl.Series:
    """Per-request input token estimate: the fixed prefix counted once, the user message from a
    counted sample's tokens-per-byte ratio (exact counts where chunking already made them)."""
    exact = "unit_tokens" in requests.columns
    est = _estimate_expr(job, requests["user"].head(_ESTIMATE_SAMPLE), exact)
    return requests.select(est.alias("est_input_tokens"))["est_input_tokens"]


def sized_requests(job: JobSpec, messages: str | Path) -> pl.DataFrame:
    """Every request of the parquet file `messages` (dedupe's to_send) without its message:
    custom_id, request_key, urgent, `estimate_input_tokens` and `line_bytes` (as `_bytes`).
    Polars' streaming engine reads the file a batch at a time, so the messages are never all
    held (at a million rows they are ~1 GB); the manifest's insert reads them again itself."""
    scan = pl.scan_parquet(messages)
    sample = scan.select("user").head(_ESTIMATE_SAMPLE).collect()["user"]
    exact = "unit_tokens" in scan.collect_schema()
    return scan.select(
        "custom_id",
        "request_key",
        "urgent",
        _estimate_expr(job, sample, exact).alias("est_input_tokens"),
        _line_bytes_expr(job).alias("_bytes"),
    ).collect(engine="streaming")


def expected_output_tokens(job: JobSpec) -> int:
    """Per-request output estimate: the few-shot answers' mean length when the job has examples
    (they show the answer's shape), else half of max_tokens."""
    answers = [e.assistant for e in job.prompt.examples]
    if answers:
        return round(sum(count_tokens(a) for a in answers) / len(answers)) + 2
    return max(1, job.model.max_tokens // 2)


def cut_shards(line_bytes: pl.Series, max_requests: int, max_bytes: int) -> pl.Series:
    """Shard number per line: contiguous shards within both limits."""
    if line_bytes.is_empty():
        return pl.Series("shard", [], dtype=pl.Int32)
    widest = int(line_bytes.cast(pl.Int64).max() or 0) + 1  # type: ignore[arg-type]
    room = max(max_bytes - widest, widest)
    frame = pl.DataFrame({"b": line_bytes + 1}).with_row_index("i")
    frame = frame.with_columns(
        (pl.col("b").cum_sum() // room).alias("byte_bucket"),
    ).with_columns(
        (pl.int_range(pl.len()).over("byte_bucket") // max_requests).alias("count_bucket")
    )
    return (
        frame.select(pl.struct("byte_bucket", "count_bucket").rank("dense").cast(pl.Int32) - 1)
        .to_series()
        .alias("shard")
    )


def plan_batches(
    job: JobSpec,
    run_id: str,
    requests: pl.DataFrame,
    *,
    backend: str,
    max_requests: int,
    max_bytes: int,
    attempt: int = 1,
    first_shard: int = 0,
    prebuilt: bool = False,
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(requests, batches, members) ready for the write-ahead manifest.

    New requests carry `user_message` and `template_id` (the line is rebuilt from the template
    when a shard is sent); requests that already carry `est_input_tokens` and `_bytes`
    (`sized_requests`) carry no message: the manifest reads it from their file. With `prebuilt`,
    `requests` carries full stored `line`s (retry rounds and re-asks resubmit lines as they
    are)."""
    if prebuilt:
        reqs = requests.with_columns(
            pl.lit(job.name).alias("job"),
            pl.lit(job.model.name).alias("model"),
            pl.col("line").str.len_bytes().alias("_bytes"),
        )
    else:
        sized = (
            requests  # sized from their file by `sized_requests`; the store reads the messages
            if "_bytes" in requests.columns
            else requests.with_columns(
                pl.col("user").alias("user_message"),
                estimate_input_tokens(job, requests).alias("est_input_tokens"),
                line_bytes(job, requests).alias("_bytes"),
            )
        )
        reqs = sized.with_columns(
            pl.lit(template_id(job)).alias("template_id"),
            pl.lit(job.name).alias("job"),
            pl.lit(job.model.name).alias("model"),
        )
    reqs = reqs.with_columns(
        (cut_shards(reqs["_bytes"], max_requests, max_bytes) + first_shard).alias("shard")
    )
    reqs = reqs.with_columns(
        (
            pl.lit(f"{run_id}-s")
            + pl.col("shard").cast(pl.String).str.zfill(4)
            + pl.lit(f"-a{attempt}")
        ).alias("batch_id")
    )
    batches = (
        reqs.group_by("batch_id", "shard", maintain_order=True)
        .agg(
            pl.len().cast(pl.Int32).alias("n_requests"),
            (pl.col("_bytes") + 1).sum().alias("n_bytes"),
            # what the batch puts in the provider's queue (lowtide/quota.py)
            pl.col("est_input_tokens").sum().cast(pl.Int64).alias("est_tokens"),
        )
        .with_columns(pl.lit(attempt).alias("attempt"), pl.lit(backend).alias("backend"))
    )
    return reqs.drop("_bytes"), batches, reqs.select("batch_id", "custom_id")


Plan = tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]


def _urgent_first(requests: pl.DataFrame, plan: Callable[[pl.DataFrame, int], Plan]) -> Plan:
    """Shards for a backend without a realtime path: the urgent requests get the first shards,
    so a pool answers them before the rest. `plan(requests, first_shard)` cuts shards."""
    urgent = requests.filter(pl.col("urgent")).drop("urgent")
    rest = requests.filter(~pl.col("urgent")).drop("urgent")
    first = plan(urgent, 0) if urgent.height else None
    after = first[1]["shard"].cast(pl.Int64).max() if first is not None else None
    second = plan(rest, int(after) + 1 if isinstance(after, int) else 0) if rest.height else None
    parts = [p for p in (first, second) if p is not None]
    return (
        pl.concat([p[0] for p in parts], how="diagonal_relaxed"),
        pl.concat([p[1] for p in parts]),
        pl.concat([p[2] for p in parts]),
    )


def estimate_usd(
    job: JobSpec, est_input_tokens: int, n_requests: int, n_realtime: int, price: dict
) -> float:
    """Batch price of every request, except `n_realtime` of them at the realtime price."""
    est_out = n_requests * expected_output_tokens(job)
    discount = price.get("batch_discount", 1.0) or 1.0
    realtime_share = n_realtime / n_requests if n_requests else 0.0
    return (
        (est_input_tokens * price.get("input", 0.0) + est_out * price.get("output", 0.0))
        / 1e6
        * (1 - realtime_share + realtime_share / discount)
    )


@task(name="assemble", task_run_name="assemble-{run_id}")
def assemble_task(ctx: RunContext, run_id: str, deduped: dict) -> dict:
    """Plan shards and commit the manifest (requests + pending batches) before any upload.

    Urgent rows ([input] priority_column) skip the batch through the backend's realtime path;
    on a backend without one (a pool) they are the first shards instead. The budget guard
    refuses the run here, before anything is written or sent."""
    started = time.perf_counter()
    job, store = ctx.job, ctx.store
    if store.has_manifest(run_id):  # written by an earlier attempt of this run
        return {"estimate_usd": None, "resumed": True}
    # the requests without their messages: those stay in the file, which only the sizing
    # and the manifest's insert read (a batch at a time)
    messages = deduped["to_send"]
    requests = sized_requests(job, messages)
    if requests.is_empty():
        return {"estimate_usd": 0.0, "resumed": False, "batches": 0}

    def plan(frame: pl.DataFrame, first_shard: int = 0) -> Plan:
        return plan_batches(
            job,
            run_id,
            frame,
            backend=ctx.backend,
            max_requests=ctx.max_requests,
            max_bytes=ctx.capabilities.max_bytes,
            first_shard=first_shard,
        )

    urgent = requests.filter(pl.col("urgent"))["custom_id"]
    reqs, batches, members = plan(requests.drop("urgent"))
    if urgent.len() and ctx.entry.has_realtime:
        # urgent requests skip the batch: re-cut the shards without them
        _, batches, members = plan(requests.filter(~pl.col("urgent")).drop("urgent"))
    elif urgent.len():
        reqs, batches, members = _urgent_first(requests, plan)
    est_in = int(reqs["est_input_tokens"].sum())
    by_realtime = urgent.len() if ctx.entry.has_realtime else 0
    estimate = estimate_usd(job, est_in, requests.height, by_realtime, ctx.price.per_mtok())
    if job.cost.budget_usd is not None and estimate > job.cost.budget_usd:
        store.record_estimate(run_id, estimate)  # the refused run keeps what it would have cost
        raise BudgetExceededError(
            f"job {job.name!r}: estimated cost ${estimate:.4f} for {requests.height} requests "
            f"exceeds the budget ${job.cost.budget_usd:g}; nothing was sent. Raise [cost] "
            f"budget_usd in {job.source_path} or run fewer rows (`lowtide estimate` quotes a run)"
        )
    if by_realtime:
        # the urgent requests' realtime batch is part of the same write-ahead manifest
        from tasks.realtime import realtime_batch_rows

        rt_batch, rt_members = realtime_batch_rows(f"{run_id}-rt-priority", urgent, 0)
        batches = pl.concat([batches, rt_batch], how="diagonal_relaxed")
        members = pl.concat([members, rt_members])
    store.save_template(template_id(job), *line_template(job))
    crash_point("mid_assembly")
    store.write_manifest(run_id, reqs, batches, members, messages=messages)
    stage_log(
        "assemble",
        "%d requests in %d batches (%d urgent), estimate $%.4f, in %.1f s",
        requests.height,
        batches.height,
        urgent.len(),
        estimate,
        time.perf_counter() - started,
    )
    return {
        "batches": batches.height,
        "urgent": urgent.len(),
        "estimate_usd": estimate,
        "est_input_tokens": est_in,
        "resumed": False,
    }
