"""assemble: unique requests → batch JSONL lines with a fixed prefix, cut into shards.

Every line shares the same system prompt and few-shot messages, in the same order, before the
unit's own message, so provider prompt caching and vLLM prefix caching apply. Shards are cut at
the backend's request and byte limits.
"""

from __future__ import annotations

import orjson
import polars as pl
from prefect import task

from lowtide.jobspec import JobSpec
from lowtide.tokens import count_tokens

_SENTINEL = "\x00lowtide-user-message\x00"
_ESTIMATE_SAMPLE = 2_000


class BudgetExceededError(RuntimeError):
    """The pre-run estimate is above the job's budget; nothing was sent."""


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


def _escaped(column: str) -> pl.Expr:
    # struct.json_encode gives {"u":"<escaped>"}; the slice keeps the quoted JSON string
    return pl.struct(pl.col(column).alias("u")).struct.json_encode().str.slice(5).str.head(-1)


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
                _escaped("user"),
                pl.lit(tail),
            ]
        ).alias("line")
    )["line"]


def line_bytes(job: JobSpec, requests: pl.DataFrame) -> pl.Series:
    """Size of each request's line in bytes, without building the lines."""
    head, mid, tail = line_template(job)
    fixed = len((head + mid + tail).encode()) + 2
    return requests.select(
        (pl.col("custom_id").str.len_bytes() + _escaped("user").str.len_bytes() + fixed).alias(
            "bytes"
        )
    )["bytes"]


def estimate_input_tokens(job: JobSpec, requests: pl.DataFrame) -> pl.Series:
    """Per-request input token estimate: the fixed prefix counted once, the user message from a
    counted sample's tokens-per-byte ratio (exact counts where chunking already made them)."""
    prefix = sum(count_tokens(m["content"]) + 4 for m in fixed_messages(job)) + 3
    sample = requests.select("user").head(_ESTIMATE_SAMPLE)["user"].to_list()
    sample_bytes = sum(len(s.encode()) for s in sample) or 1
    ratio = sum(count_tokens(s) for s in sample) / sample_bytes
    est_user = (pl.col("user").str.len_bytes() * ratio).round().cast(pl.Int64) + 4
    return requests.select((pl.lit(prefix) + est_user).alias("est_input_tokens"))[
        "est_input_tokens"
    ]


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
    widest = int(line_bytes.max() or 0) + 1
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
    when a shard is sent). With `prebuilt`, `requests` carries full stored `line`s (retry rounds
    and re-asks resubmit lines as they are)."""
    if prebuilt:
        reqs = requests.with_columns(
            pl.lit(job.name).alias("job"),
            pl.lit(job.model.name).alias("model"),
            pl.col("line").str.len_bytes().alias("_bytes"),
        )
    else:
        reqs = requests.with_columns(
            pl.col("user").alias("user_message"),
            pl.lit(template_id(job)).alias("template_id"),
            estimate_input_tokens(job, requests).alias("est_input_tokens"),
            line_bytes(job, requests).alias("_bytes"),
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
        )
        .with_columns(pl.lit(attempt).alias("attempt"), pl.lit(backend).alias("backend"))
    )
    return reqs.drop("_bytes"), batches, reqs.select("batch_id", "custom_id")


@task(name="assemble", task_run_name="assemble-{job.name}")
def assemble_task(
    job: JobSpec,
    deduped: dict,
    run_id: str,
    state_path: str,
    backend: str,
    max_requests: int,
    max_bytes: int,
    price_per_mtok: dict,
) -> dict:
    """Plan shards and commit the manifest (requests + pending batches) before any upload."""
    from lowtide.store.state import Store

    store = Store(state_path)
    existing = store.run_batches(run_id)
    if existing.height:  # manifest already written by an earlier attempt of this run
        return {
            "batches": existing["batch_id"].to_list(),
            "urgent": [],
            "estimate_usd": None,
            "resumed": True,
        }
    requests = pl.read_parquet(deduped["to_send"])
    if requests.is_empty():
        return {"batches": [], "urgent": [], "estimate_usd": 0.0, "resumed": False}
    urgent_mask = requests["urgent"] if "urgent" in requests.columns else None
    reqs, batches, members = plan_batches(
        job,
        run_id,
        requests.drop("urgent", strict=False),
        backend=backend,
        max_requests=max_requests,
        max_bytes=max_bytes,
    )
    urgent: list[str] = []
    if urgent_mask is not None and urgent_mask.any():
        # urgent requests skip the batch: re-cut the shards without them
        urgent = requests.filter(urgent_mask)["custom_id"].to_list()
        _, batches, members = plan_batches(
            job,
            run_id,
            requests.filter(~urgent_mask).drop("urgent"),
            backend=backend,
            max_requests=max_requests,
            max_bytes=max_bytes,
        )
    est_in = int(reqs["est_input_tokens"].sum())
    est_out = requests.height * expected_output_tokens(job)
    discount = price_per_mtok.get("batch_discount", 1.0) or 1.0
    urgent_share = len(urgent) / requests.height
    estimate = (
        (est_in * price_per_mtok.get("input", 0.0) + est_out * price_per_mtok.get("output", 0.0))
        / 1e6
        * (1 - urgent_share + urgent_share / discount)
    )
    if job.cost.budget_usd is not None and estimate > job.cost.budget_usd:
        raise BudgetExceededError(
            f"job {job.name!r}: estimated cost ${estimate:.2f} for {requests.height} requests "
            f"exceeds the budget ${job.cost.budget_usd:.2f} ([cost] budget_usd); nothing was sent"
        )
    if urgent:
        # the urgent requests' realtime batch is part of the same write-ahead manifest
        from tasks.realtime import realtime_batch_rows

        rt_batch, rt_members = realtime_batch_rows(
            f"{run_id}-rt-priority", pl.Series("custom_id", urgent, dtype=pl.String), 0
        )
        batches = pl.concat([batches, rt_batch], how="diagonal_relaxed")
        members = pl.concat([members, rt_members])
    store.save_template(template_id(job), *line_template(job))
    store.write_manifest(run_id, reqs, batches, members)
    return {
        "batches": batches["batch_id"].to_list(),
        "urgent": urgent,
        "estimate_usd": estimate,
        "est_input_tokens": est_in,
        "resumed": False,
    }
