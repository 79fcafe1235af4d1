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
from prefect import task

from lowtide.jobspec import RetrySpec

REASK_SUFFIX = "_r1"

# Provider errors that another attempt can fix: rate limits, overload, server errors, timeouts.
_TRANSIENT_ERROR = re.compile(
    r"HTTP (408|409|429|5\d\d)|overloaded|api_error|rate_limit|timeout|server_error", re.I
)
_RETRYABLE = ("expired", "cancelled")


def retry_plan(
    outcomes: pl.DataFrame, spec: RetrySpec, *, past_deadline: bool
) -> dict[str, list[str]]:
    """Split unanswered requests into resubmit / realtime / reask lists of custom_ids.

    `outcomes`: one row per request of the run with custom_id, outcome, error, finish_reason,
    batch_attempts, realtime_attempts and has_reask.
    """
    transient = (pl.col("outcome") == "provider_error") & pl.col("error").fill_null(
        ""
    ).str.contains(_TRANSIENT_ERROR.pattern)
    retryable = transient | pl.col("outcome").is_in(_RETRYABLE)
    can_batch = pl.col("batch_attempts") < spec.max_attempts
    untried_realtime = pl.col("realtime_attempts") == 0
    resubmit = pl.lit(False) if past_deadline else retryable & can_batch
    realtime = retryable & ~resubmit & untried_realtime & pl.lit(spec.realtime_fallback)
    reask = (pl.col("outcome") == "parse_failed") & ~pl.col("has_reask") & pl.lit(spec.reask)
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


@task(name="plan-retries", task_run_name="plan-retries-{run_id}")
def plan_retries_task(
    run_id: str, state_path: str, spec: RetrySpec, past_deadline: bool
) -> dict[str, list[str]]:
    from lowtide.store.state import Store

    store = Store(state_path)
    return retry_plan(
        store.run_request_outcomes(run_id),
        spec,
        past_deadline=past_deadline,
    )
