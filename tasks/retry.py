"""retry: what to do with requests that did not come back answered.

Per request, from its outcome and how many batch attempts it already had:
- errored (transient), expired, cancelled (not by the user) → a new attempt in a new batch,
  up to `max_attempts`; after that, or past the deadline, once through the realtime path;
- an unparseable or cut-off answer → re-asked once as a new request (its own custom_id, a larger
  max_tokens and a note on what was wrong), whose answer repairs the original;
- anything else stays failed with its reason.
"""

from __future__ import annotations

import re

import orjson
import polars as pl

from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.jobspec import RetrySpec
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.vocabulary import Outcome, RunStatus
from tasks.assemble import BATCH_ROW_SCHEMA, plan_batches
from tasks.realtime import deadline_passed, plan_realtime

REASK_SUFFIX = "_r1"

# Provider errors that another attempt can fix: rate limits, overload, server errors, timeouts.
_TRANSIENT_ERROR = re.compile(
    r"HTTP (408|409|429|5\d\d)|overloaded|api_error|rate_limit|timeout|server_error", re.I
)
_RETRYABLE = ("expired", "cancelled")
_ERRORED = Outcome.PROVIDER_ERROR.value  # retried when its error is transient
_UNPARSEABLE = Outcome.PARSE_FAILED.value  # re-asked
ACTED_ON = (_ERRORED, *_RETRYABLE, _UNPARSEABLE)
"""The outcomes `retry_plan` may act on: a round reads only the requests that ended so."""


def retry_plan(
    outcomes: pl.DataFrame, spec: RetrySpec, *, past_deadline: bool
) -> dict[str, list[str]]:
    """Split unanswered requests into resubmit / realtime / reask lists of custom_ids.

    `outcomes`: one row per request of the run with custom_id, outcome, error, finish_reason,
    batch_attempts, realtime_attempts and has_reask.
    """
    transient = (pl.col("outcome") == _ERRORED) & pl.col("error").fill_null("").str.contains(
        _TRANSIENT_ERROR.pattern
    )
    retryable = transient | pl.col("outcome").is_in(_RETRYABLE)
    can_batch = pl.col("batch_attempts") < spec.max_attempts
    untried_realtime = pl.col("realtime_attempts") == 0
    resubmit = pl.lit(False) if past_deadline else retryable & can_batch
    realtime = retryable & ~resubmit & untried_realtime & pl.lit(spec.realtime_fallback)
    reask = (pl.col("outcome") == _UNPARSEABLE) & ~pl.col("has_reask") & pl.lit(spec.reask)
    plan = outcomes.select(
        "custom_id", resubmit.alias("resubmit"), realtime.alias("realtime"), reask.alias("reask")
    )
    return {
        name: plan.filter(pl.col(name))["custom_id"].to_list()
        for name in ("resubmit", "realtime", "reask")
    }


def _problem_kind(error: str | None, finish_reason: str | None) -> str:
    if finish_reason == "length" or (error or "").startswith("truncated"):
        return "it was cut off at the token limit"
    if (error or "").startswith("json"):
        return "it was not valid JSON"
    return "it did not match the required format"


def reask_line(line: str, error: str | None, finish_reason: str | None, factor: float) -> str:
    """The re-ask of one stored request line: own custom_id, more room, a note on the problem.

    The note is appended to the last user message (not sent as a new turn) so the question the
    model answers stays the same; it names no output values, so it cannot steer the answer.
    """
    request = orjson.loads(line)
    body = request["body"]
    body["max_tokens"] = int(body.get("max_tokens", 256) * factor)
    last = body["messages"][-1]
    last["content"] = (
        f"{last['content']}\n\n(Note: a previous reply could not be used because "
        f"{_problem_kind(error, finish_reason)}. Reply with the JSON object only.)"
    )
    request["custom_id"] = request["custom_id"] + REASK_SUFFIX
    return orjson.dumps(request).decode()


def _reask_requests(lines: pl.DataFrame, factor: float) -> pl.DataFrame:
    """New requests that re-ask these stored ones (few: only unparseable answers)."""
    return lines.select(
        (pl.col("custom_id") + REASK_SUFFIX).alias("custom_id"),
        (pl.col("request_key") + ":reask").alias("request_key"),
        pl.struct("line", "error", "finish_reason")
        .map_elements(
            lambda r: reask_line(r["line"], r["error"], r["finish_reason"], factor),
            return_dtype=pl.String,
        )
        .alias("line"),
        pl.col("est_input_tokens"),
        pl.col("custom_id").alias("reask_of"),
    )


def _new_batches(ctx: RunContext, run_id: str, lines: pl.DataFrame) -> None:
    """Write-ahead manifest for a retry round: new batches for already-built request lines."""
    reqs, batches, members = plan_batches(
        ctx.job,
        run_id,
        lines.select(
            "custom_id",
            "request_key",
            "line",
            *(["reask_of"] if "reask_of" in lines.columns else []),
            "est_input_tokens",
        ),
        backend=ctx.backend,
        max_requests=ctx.max_requests,
        max_bytes=ctx.capabilities.max_bytes,
        attempt=ctx.store.next_attempt(run_id),
        prebuilt=True,
    )
    ctx.store.write_manifest(run_id, reqs, batches, members)


def _write_requests(ctx: RunContext, run_id: str, lines: pl.DataFrame) -> None:
    """Requests without a batch of their own (they go through a realtime batch)."""
    job = ctx.job
    ctx.store.write_manifest(
        run_id,
        lines.with_columns(pl.lit(job.name).alias("job"), pl.lit(job.model.name).alias("model")),
        pl.DataFrame(schema=BATCH_ROW_SCHEMA),
        pl.DataFrame(schema={"batch_id": pl.String, "custom_id": pl.String}),
    )


@task(name="retry-round", task_run_name="retry-round-{run_id}")
def retry_round_task(ctx: RunContext, run_id: str) -> bool:
    """Plan the next round for the run's unanswered requests and commit its manifest: new
    batches for retries and re-asks, a realtime batch for stragglers (on backends with a
    realtime path). True if a round was started; a run being cancelled gets none."""
    store, job = ctx.store, ctx.job
    run = store.require_run(run_id)
    if run["status"] == RunStatus.CANCELLING.value:
        return False
    plan = retry_plan(
        store.run_request_outcomes(run_id, ACTED_ON),
        job.retry,
        past_deadline=deadline_passed(run.get("started_at"), job.retry.deadline_hours),
    )
    realtime = ctx.entry.has_realtime
    if plan["resubmit"]:
        _new_batches(ctx, run_id, store.request_lines(plan["resubmit"]))
    if plan["reask"]:
        reasks = _reask_requests(
            store.request_lines(plan["reask"]), job.retry.reask_max_tokens_factor
        )
        if job.retry.reask_via == "realtime" and realtime:
            _write_requests(ctx, run_id, reasks)
            plan_realtime(store, run_id, reasks["custom_id"].to_list(), "reask")
        else:
            _new_batches(ctx, run_id, reasks)
    # a backend without a realtime path (a pool) already answers as it goes: no fallback
    fallback = plan["realtime"] if realtime else []
    if fallback:
        plan_realtime(store, run_id, fallback, "fallback")
    started = bool(plan["resubmit"] or plan["reask"] or fallback)
    if started:
        crash_point("in_retry_round")
        stage_log(
            "retry",
            "%d resubmitted, %d re-asked, %d through the realtime path",
            len(plan["resubmit"]),
            len(plan["reask"]),
            len(fallback),
        )
    return started
