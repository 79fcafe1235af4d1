"""parse/repair: raw answer text → validated output, or a failed row with the reason.

Ladder: strict JSON parse + schema validation → `ok`; else json-repair (code fences, trailing
commas, quotes, cut-off text) and validate again → `repaired`; else `parse_failed` with the parse
or validation error. Requests the provider did not answer keep their provider outcome.
"""

from __future__ import annotations

from typing import Any

import json_repair
import jsonschema_rs
import orjson
import polars as pl

from lowtide.backends import EMULATOR_ENGINE
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.store import Store
from lowtide.vocabulary import Outcome, RequestStatus

Validator = Any  # jsonschema_rs validators share no importable base class

_PROVIDER_OUTCOME = {
    RequestStatus.PROVIDER_ERROR.value: Outcome.PROVIDER_ERROR.value,
    RequestStatus.EXPIRED.value: Outcome.EXPIRED.value,
    RequestStatus.CANCELLED.value: Outcome.CANCELLED.value,
    RequestStatus.MISSING.value: Outcome.MISSING.value,
}


def compile_schema(schema: dict[str, Any]) -> Validator:
    """A compiled validator (Rust; ~40x faster than a pure-Python one on the hot path)."""
    return jsonschema_rs.validator_for(schema)


def _first_error(validator: Validator, value: Any) -> str | None:
    if validator.is_valid(value):
        return None
    err = next(iter(validator.iter_errors(value)))
    where = "/".join(str(p) for p in err.instance_path) or "(root)"
    return f"schema: at {where}: {err.message}"


def parse_one(
    raw: str | None, finish_reason: str | None, validator: Validator
) -> tuple[str, str | None, str | None]:
    """(outcome, output JSON or None, error or None) for one answer text."""
    if raw is None:
        return "parse_failed", None, "empty answer"
    try:
        value = orjson.loads(raw)
        problem = _first_error(validator, value)
        if problem is None:
            return "ok", orjson.dumps(value).decode(), None
    except orjson.JSONDecodeError as e:
        problem = f"json: {e}"
    repaired = json_repair.loads(raw)
    if repaired not in ("", None) and _first_error(validator, repaired) is None:
        return "repaired", orjson.dumps(repaired).decode(), None
    if finish_reason == "length":
        problem = f"truncated at max_tokens ({problem})"
    return "parse_failed", None, problem


def parse_results(joined: pl.DataFrame, schema: dict[str, Any]) -> pl.DataFrame:
    """Add `outcome` and `output` to joined results; the error column explains every failure."""
    validator = compile_schema(schema)
    answered = joined["status"] == "answered"
    outcomes: list[str] = []
    outputs: list[str | None] = []
    errors: list[str | None] = []
    for is_answer, status, raw, finish, err in zip(
        answered.to_list(),
        joined["status"].to_list(),
        joined["raw_text"].to_list(),
        joined["finish_reason"].to_list(),
        joined["error"].to_list(),
        strict=True,
    ):
        if is_answer:
            outcome, output, problem = parse_one(raw, finish, validator)
            if outcome == "parse_failed" and err:  # e.g. a refusal
                problem = f"{err}; {problem}"
        else:
            outcome, output, problem = _PROVIDER_OUTCOME.get(status, "missing"), None, err
        outcomes.append(outcome)
        outputs.append(output)
        errors.append(problem)
    return joined.with_columns(
        pl.Series("outcome", outcomes, dtype=pl.String),
        pl.Series("output", outputs, dtype=pl.String),
        pl.Series("error", errors, dtype=pl.String),
    )


def answered_by(parsed: pl.DataFrame, engine: str) -> pl.Expr:
    """Which engine gave each result: the emulator when the answer carries its fingerprint
    (whichever backend's client asked), else `engine`, the run's answer family."""
    # a results file joined before answers carried the mark has no `emulated` column
    emulated = pl.col("emulated").fill_null(False) if "emulated" in parsed.columns else False
    return pl.when(emulated).then(pl.lit(EMULATOR_ENGINE)).otherwise(pl.lit(engine))


def store_parsed(
    store: Store,
    parsed: pl.DataFrame,
    *,
    batch_id: str,
    run_id: str,
    engine: str,
    channel: str = "batch",
) -> dict[str, int]:
    """Upsert parsed results (by custom_id) with how often each request was tried and which
    engine answered (`answered_by`); returns the count per outcome. One place for every
    channel: batch, realtime and pool."""
    rows = parsed.join(
        store.attempt_counts(parsed["custom_id"]), on="custom_id", how="left"
    ).select(
        "custom_id",
        pl.lit(batch_id).alias("batch_id"),
        pl.lit(run_id).alias("run_id"),
        "outcome",
        "output",
        "raw_text",
        "finish_reason",
        "error",
        "input_tokens",
        "cached_tokens",
        "output_tokens",
        pl.col("attempts").fill_null(1),
        pl.lit(channel).alias("channel"),
        pl.lit(None, pl.Float64).alias("cost_usd"),  # priced by reconcile, never left stale
        answered_by(parsed, engine).alias("engine"),
    )
    store.upsert_results(rows)
    counts = parsed["outcome"].value_counts()
    return dict(zip(counts["outcome"].to_list(), counts["count"].to_list(), strict=True))


@task(name="parse", task_run_name="parse-{batch_id}")
def parse_task(ctx: RunContext, batch_id: str, joined: dict) -> dict:
    """Validate a batch's answers and store them (upsert by custom_id); mark the batch collected."""
    store = ctx.store
    parsed = parse_results(pl.read_parquet(joined["results"]), ctx.job.output_schema)
    # three short store calls back to back: the file stays attached across them (each attach
    # and detach would checkpoint the growing results table again)
    with store.held():
        counts = store_parsed(
            store, parsed, batch_id=batch_id, run_id=joined["run_id"], engine=ctx.answer_family
        )
        crash_point("mid_parse")
        store.mark_collected(batch_id)
    stage_log("parse", "%s: %s", batch_id, counts)
    return counts
