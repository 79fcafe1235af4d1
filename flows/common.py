"""Steps shared by the enrich and collect flows: drive a run's batches to the end, then finish it.

`drive_run` is the loop both flows use: submit what is pending, poll, collect ended batches
(join + parse), plan retries and re-asks, repeat; `finish_run` scores, prices, publishes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import polars as pl

from lowtide import progress
from lowtide.backends import make_backend
from lowtide.backends.base import BatchStatus, TerminalBackendError
from lowtide.jobspec import JobSpec
from lowtide.pricing import Price, load_price
from lowtide.settings import Settings
from lowtide.store.state import Store
from tasks.assemble import plan_batches
from tasks.finalize import finalize_task, publish_task
from tasks.join import join_task
from tasks.load import load_eval_set
from tasks.parse import parse_task
from tasks.poll import poll_task
from tasks.qa import qa_task
from tasks.realtime import deadline_passed, plan_realtime, realtime_task
from tasks.reconcile import reconcile_task
from tasks.retry import plan_retries_task, reask_line
from tasks.stream import stream_task
from tasks.submit import submit_task


@dataclass
class RunContext:
    """Where a run lives and how to reach its engine; plain values, resolved once."""

    settings: Settings
    store: Store
    backend_name: str
    emulator_url: str | None
    price: Price

    @property
    def state_path(self) -> str:
        return str(self.settings.state)

    def work_dir(self, run_id: str) -> str:
        return str(self.settings.work_dir / run_id)


def now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def price_for(job: JobSpec, backend_name: str) -> Price:
    if backend_name == "vllm":  # priced by GPU time in tasks/stream.py, not per token
        return Price("vllm", job.model.name, "gpu-hour", 0.0, 0.0, 0.0, 1.0)
    provider = "emulator" if backend_name == "emulator" else backend_name
    return load_price(job.resolve(job.cost.price_table), provider, job.model.name)


@contextlib.contextmanager
def emulator_for(backend: str, url: str | None) -> Iterator[str | None]:
    """The emulator's base URL: the given one, LOWTIDE_EMULATOR_URL, or one started in-process."""
    url = url or os.environ.get("LOWTIDE_EMULATOR_URL")
    if backend != "emulator" or url:
        yield url
        return
    from lowtide.emulator.config import EmulatorConfig
    from lowtide.emulator.server import Emulator

    with Emulator(EmulatorConfig(time_scale=600.0)) as emu:
        yield emu.base_url


def submit_pending(job: JobSpec, ctx: RunContext, run_id: str) -> int:
    """Send every batch of the run that has not been sent yet; returns how many. Realtime
    batches are answered here and now; on the vllm backend each pending shard is streamed
    through the pool to the end instead."""
    _send_realtime_pending(job, ctx, run_id)
    if ctx.backend_name == "vllm":
        return _stream_pending(job, ctx, run_id)
    pending = ctx.store.query(
        "SELECT batch_id FROM batches WHERE run_id = ? AND provider_batch_id IS NULL "
        "AND backend <> 'realtime' AND status IN ('pending', 'uploaded') ORDER BY attempt, shard",
        [run_id],
    )["batch_id"].to_list()
    for i, batch_id in enumerate(pending):
        progress.report("submit", i, len(pending))
        try:
            submit_task(batch_id, ctx.state_path, ctx.backend_name, ctx.emulator_url)
        except TerminalBackendError as e:
            # the provider refused this batch for good: its requests end failed with the reason
            ctx.store.update_batch(
                batch_id,
                status=BatchStatus.FAILED.value,
                errors=orjson.dumps([{"code": "rejected", "message": str(e)}]).decode(),
            )
    if pending:
        _count_sent(ctx, run_id)
    return len(pending)


def _count_sent(ctx: RunContext, run_id: str) -> None:
    sent = ctx.store.scalar(
        "SELECT count(DISTINCT custom_id) FROM batch_requests br JOIN batches b USING (batch_id) "
        "WHERE b.run_id = ?",
        [run_id],
    )
    run = ctx.store.get_run(run_id) or {}
    status = {} if run.get("status") == "cancelling" else {"status": "submitted"}
    ctx.store.update_run(run_id, requests_sent=int(sent or 0), **status)


def _send_realtime_pending(job: JobSpec, ctx: RunContext, run_id: str) -> None:
    pending = ctx.store.query(
        "SELECT batch_id FROM batches WHERE run_id = ? AND backend = 'realtime' "
        "AND status = 'pending' ORDER BY created_at",
        [run_id],
    )["batch_id"].to_list()
    for batch_id in pending:
        realtime_task(
            batch_id,
            run_id,
            ctx.state_path,
            ctx.backend_name,
            ctx.emulator_url,
            job.output_schema,
            job.retry.realtime_concurrency,
        )
    if pending:
        ctx.store.fold_reasks()
        _count_sent(ctx, run_id)


def _stream_pending(job: JobSpec, ctx: RunContext, run_id: str) -> int:
    shards = ctx.store.query(
        "SELECT batch_id FROM batches WHERE run_id = ? AND backend = 'vllm' AND NOT collected "
        "ORDER BY attempt, shard",
        [run_id],
    )["batch_id"].to_list()
    for batch_id in shards:
        ctx.store.update_run(run_id, status="submitted")
        stream_task(job, batch_id, run_id, ctx.state_path)
    if shards:
        ctx.store.fold_reasks()
    return len(shards)


def collect_ended(job: JobSpec, ctx: RunContext, run_id: str) -> int:
    """Join and parse every ended, uncollected batch of the run; returns how many."""
    ended = ctx.store.query(
        "SELECT batch_id FROM batches WHERE run_id = ? AND NOT collected "
        "AND status IN ('completed', 'failed', 'expired', 'cancelled') ORDER BY attempt, shard",
        [run_id],
    )["batch_id"].to_list()
    for batch_id in ended:
        progress.report("collect", 0, 0, batch_id)
        joined = join_task(
            batch_id, ctx.state_path, ctx.backend_name, ctx.emulator_url, ctx.work_dir(run_id)
        )
        parse_task(joined, batch_id, job.output_schema, ctx.state_path, run_id)
    if ended:
        ctx.store.fold_reasks()
    return len(ended)


def schedule_retries(job: JobSpec, ctx: RunContext, run_id: str) -> bool:
    """Plan and start the next round for unanswered requests; True if anything was started.
    A run being cancelled gets no further round."""
    run = ctx.store.get_run(run_id) or {}
    if run.get("status") == "cancelling":
        return False
    plan = plan_retries_task(
        run_id,
        ctx.state_path,
        job.retry,
        deadline_passed(run.get("started_at"), job.retry.deadline_hours),
    )
    started = False
    if plan["resubmit"]:
        _new_batches(job, ctx, run_id, ctx.store.request_lines(plan["resubmit"]))
        started = True
    if plan["reask"]:
        lines = ctx.store.request_lines(plan["reask"])
        reasks = lines.select(
            (pl.col("custom_id") + "_r1").alias("custom_id"),
            (pl.col("request_key") + ":reask").alias("request_key"),
            pl.struct("line", "error", "finish_reason")
            .map_elements(
                lambda r: reask_line(
                    r["line"], r["error"], r["finish_reason"], job.retry.reask_max_tokens_factor
                ),
                return_dtype=pl.String,
            )
            .alias("line"),
            pl.col("est_input_tokens"),
            pl.col("custom_id").alias("reask_of"),
        )
        if job.retry.reask_via == "realtime" and ctx.backend_name != "vllm":
            _write_requests(job, ctx, run_id, reasks)
            plan_realtime(ctx.store, run_id, reasks["custom_id"].to_list(), "reask")
        else:
            _new_batches(job, ctx, run_id, reasks)
        started = True
    if plan["realtime"] and ctx.backend_name != "vllm":  # the pool is already "realtime"
        plan_realtime(ctx.store, run_id, plan["realtime"], "fallback")
        started = True
    return started


def _write_requests(job: JobSpec, ctx: RunContext, run_id: str, lines: pl.DataFrame) -> None:
    empty = pl.DataFrame(
        schema={
            "batch_id": pl.String,
            "shard": pl.Int32,
            "attempt": pl.Int32,
            "backend": pl.String,
            "n_requests": pl.Int32,
            "n_bytes": pl.Int64,
        }
    )
    ctx.store.write_manifest(
        run_id,
        lines.with_columns(pl.lit(job.name).alias("job"), pl.lit(job.model.name).alias("model")),
        empty,
        pl.DataFrame(schema={"batch_id": pl.String, "custom_id": pl.String}),
    )


def _new_batches(job: JobSpec, ctx: RunContext, run_id: str, lines: pl.DataFrame) -> None:
    """Write-ahead manifest for a retry round: new batches for already-built request lines."""
    attempt = (
        int(
            ctx.store.scalar(
                "SELECT coalesce(max(attempt), 1) FROM batches WHERE run_id = ?", [run_id]
            )
        )
        + 1
    )
    caps = make_backend(ctx.backend_name, emulator_url=ctx.emulator_url).capabilities
    max_requests = min(caps.max_requests, ctx.settings.shard_max_requests or caps.max_requests)
    reqs, batches, members = plan_batches(
        job,
        run_id,
        lines.select(
            "custom_id",
            "request_key",
            "line",
            *(["reask_of"] if "reask_of" in lines.columns else []),
            "est_input_tokens",
        ),
        backend=ctx.backend_name,
        max_requests=max_requests,
        max_bytes=caps.max_bytes,
        attempt=attempt,
        prebuilt=True,
    )
    ctx.store.write_manifest(run_id, reqs, batches, members)


def drive_run(job: JobSpec, ctx: RunContext, run_id: str, wait: bool) -> bool:
    """Advance the run as far as possible; True when every request has its final outcome."""
    while True:
        submit_pending(job, ctx, run_id)
        ended = poll_task(
            run_id,
            ctx.state_path,
            ctx.backend_name,
            ctx.emulator_url,
            wait,
            ctx.settings.poll_max_interval_s,
        )
        collect_ended(job, ctx, run_id)
        if not ended:
            return False
        if schedule_retries(job, ctx, run_id):
            if not wait:
                submit_pending(job, ctx, run_id)
                if ctx.store.open_batches(run_id).height:
                    return False
            continue
        return True


def finish_run(job: JobSpec, ctx: RunContext, run_id: str) -> None:
    """Score, price, count and publish a run whose requests all have final outcomes."""
    store = ctx.store
    progress.report("qa")
    gold = load_eval_set(job)
    eval_path = None
    if gold is not None:
        eval_path = f"{ctx.work_dir(run_id)}/eval-gold.parquet"
        os.makedirs(ctx.work_dir(run_id), exist_ok=True)
        gold.write_parquet(eval_path)
    qa = qa_task(job, run_id, ctx.state_path, eval_path)
    run = store.get_run(run_id) or {}
    cost = reconcile_task(
        run_id, ctx.state_path, ctx.price, ctx.backend_name, run.get("estimate_usd")
    )
    counts = finalize_task(run_id, ctx.state_path)
    status = "cancelled" if run.get("status") == "cancelling" else "completed"
    if qa["hold"] and status == "completed":
        status = "held"  # results are kept; the job view keeps the last published run
    sent = store.scalar(
        "SELECT count(DISTINCT custom_id) FROM batch_requests br JOIN batches b USING (batch_id) "
        "WHERE b.run_id = ?",
        [run_id],
    )
    store.update_run(
        run_id,
        status=status,
        published_at=now() if status == "completed" else None,
        requests_sent=int(sent or 0),
        gate_note="; ".join(qa["hold"]) or None,
        finished_at=now(),
        succeeded=counts["succeeded"],
        failed=counts["failed"],
        eval_accuracy=qa["eval_accuracy"],
        cost_usd=cost["cost_usd"],
        realtime_cost_usd=cost["realtime_cost_usd"]
        + cost.get("dedupe_savings_usd", 0.0)
        + cost.get("cache_savings_usd", 0.0),
    )
    progress.report("publish")
    # a held or cancelled run is in the tables, but the job view keeps the last published run
    publish_task(run_id, ctx.state_path, str(ctx.settings.db), store.job_views(), mark=False)


def summary(store: Store, run_id: str, settings: Settings) -> dict[str, Any]:
    """Everything a person or a script wants to know about a run, as plain values."""
    run = store.get_run(run_id) or {}
    tokens = store.query(
        "SELECT coalesce(sum(input_tokens),0) AS input_tokens, "
        "coalesce(sum(cached_tokens),0) AS cached_tokens, "
        "coalesce(sum(output_tokens),0) AS output_tokens FROM costs "
        "WHERE run_id = ? AND level = 'run'",
        [run_id],
    ).row(0, named=True)
    metrics = dict(
        store.query("SELECT name, value FROM metrics WHERE run_id = ?", [run_id]).iter_rows()
    )
    reasons = store.query(
        "SELECT reason, count(*) AS n FROM failures WHERE run_id = ? AND kind = 'row' "
        "GROUP BY 1 ORDER BY 2 DESC",
        [run_id],
    )
    evals = store.query(
        "SELECT field, accuracy FROM eval_scores WHERE run_id = ? ORDER BY field", [run_id]
    )
    units = store.query(
        "SELECT count(*) FILTER (WHERE kind = 'row' AND cache_hit) AS row_units_cached, "
        "count(*) FILTER (WHERE kind = 'eval') AS eval_units, "
        "(SELECT count(*) FROM qa_samples WHERE run_id = ?) AS qa_samples "
        "FROM units WHERE run_id = ?",
        [run_id, run_id],
    ).row(0, named=True)
    previous = store.query(
        "SELECT field, accuracy FROM eval_scores WHERE run_id = (SELECT run_id FROM runs "
        "WHERE job = ? AND published_at IS NOT NULL AND run_id <> ? "
        "ORDER BY published_at DESC LIMIT 1) ORDER BY field",
        [run.get("job"), run_id],
    )
    return {
        **{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in run.items()},
        **tokens,
        **units,
        "metrics": metrics,
        "failures_by_reason": dict(reasons.iter_rows()),
        "eval_by_field": dict(evals.iter_rows()),
        "eval_previous_by_field": dict(previous.iter_rows()),
        "db": str(settings.db),
        "state": str(settings.state),
    }
