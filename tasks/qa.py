"""qa: a deterministic review sample of the run's outputs, and the eval set scored.

The sample is chosen by a hash of (seed, unit_id), so the same job and seed always pick the same
units, whatever the order or size of the input. Eval units are answered in the same batches as
the rows and compared field by field with the gold labels.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import polars as pl

from lowtide.context import RunContext
from lowtide.digests import md5_fraction
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.vocabulary import ANSWERED
from tasks.load import EVAL_FILE, load_eval_set


def sample_order(unit_ids: pl.Series, seed: int) -> pl.Series:
    """A stable pseudo-random rank key per unit: md5(seed:unit_id) as a fraction in [0, 1)."""
    return md5_fraction(unit_ids, seed)


def no_sample() -> pl.DataFrame:
    """An empty review sample."""
    return pl.DataFrame(schema={"unit_id": pl.String, "source_id": pl.String, "output": pl.String})


def qa_sample(
    outcomes: pl.DataFrame, rate: float, seed: int, stratify_by: str | None = None
) -> pl.DataFrame:
    """The review sample: `rate` of the answered rows, the same for the same seed.

    With `stratify_by` (an enum output field), each label gets its share of the sample and at
    least one unit, so rare labels are reviewed too.
    """
    rows = outcomes.filter((pl.col("kind") == "row") & pl.col("outcome").is_in(ANSWERED))
    if rows.is_empty() or rate <= 0:
        return no_sample()
    rows = rows.with_columns(sample_order(rows["unit_id"], seed).alias("_k"))
    if stratify_by is None:
        return rows.filter(pl.col("_k") < rate).select("unit_id", "source_id", "output")
    rows = rows.with_columns(
        pl.col("output").str.json_path_match(f"$.{stratify_by}").alias("_label")
    )
    quota = (pl.len().over("_label") * rate).round().clip(lower_bound=1)
    picked = rows.filter(pl.col("_k").rank("ordinal").over("_label") <= quota)
    return picked.sort("unit_id").select("unit_id", "source_id", "output")


def eval_scores(
    outcomes: pl.DataFrame, gold: pl.DataFrame, fields: list[str], job: str
) -> pl.DataFrame:
    """Per-field accuracy over the eval set; unanswered or invalid answers count as wrong."""
    evals = outcomes.filter(pl.col("kind") == "eval").select("source_id", "outcome", "output")
    joined = gold.join(evals, on="source_id", how="left")
    n = joined.height
    valid_rate = joined["outcome"].is_in(ANSWERED).fill_null(False).cast(pl.Float64).mean()
    parsed = [orjson.loads(o) if o else {} for o in joined["output"].to_list()]
    rows = []
    for field in fields:
        truth = joined[field].cast(pl.String).to_list()
        got = [str(p.get(field)) if field in p else None for p in parsed]
        correct = sum(1 for t, g in zip(truth, got, strict=True) if t is not None and t == g)
        rows.append(
            {
                "job": job,
                "field": field,
                "n": n,
                "correct": correct,
                "accuracy": correct / n if n else None,
                "schema_valid_rate": valid_rate if n else None,
            }
        )
    return pl.DataFrame(
        rows,
        schema={
            "job": pl.String,
            "field": pl.String,
            "n": pl.Int64,
            "correct": pl.Int64,
            "accuracy": pl.Float64,
            "schema_valid_rate": pl.Float64,
        },
    )


def eval_gate(
    current: pl.DataFrame, previous: pl.DataFrame | None, max_drop: float, floor: float | None
) -> list[str]:
    """Reasons to hold a run: a field whose accuracy fell more than `max_drop` below the last
    published run, or below `floor`. Empty when the run may be published."""
    reasons = []
    before = (
        {} if previous is None else dict(zip(previous["field"], previous["accuracy"], strict=True))
    )
    for field, acc in zip(current["field"], current["accuracy"], strict=True):
        if acc is None:
            continue
        prev = before.get(field)
        if prev is not None and prev - acc > max_drop + 1e-12:
            reasons.append(
                f"{field} accuracy fell {100 * (prev - acc):.1f} points ({prev:.1%} → {acc:.1%}), "
                f"more than the {100 * max_drop:.1f} allowed"
            )
        if floor is not None and acc < floor:
            reasons.append(f"{field} accuracy {acc:.1%} is below the floor {floor:.1%}")
    return reasons


def eval_unanswered(outcomes: pl.DataFrame, gold: pl.DataFrame) -> list[str]:
    """A reason to hold a run whose eval set got no answer at all: its accuracy would be a
    blank, not a measure, so drift could not be seen."""
    evals = outcomes.filter(pl.col("kind") == "eval")
    if gold.is_empty() or evals["outcome"].is_in(ANSWERED).any():
        return []
    return [f"the eval set went unanswered (none of its {gold.height} rows got a valid answer)"]


def failed_share_gate(rows: int, failed: int, max_share: float) -> list[str]:
    """A reason to hold a run whose failed rows are more than `max_share` of its rows
    (`[qa] max_failed_share`); empty when it may be published."""
    if not rows or failed / rows <= max_share:
        return []
    return [
        f"{failed} of {rows} rows failed ({failed / rows:.1%}), more than the "
        f"{max_share:.1%} [qa] max_failed_share allows"
    ]


def _gold(ctx: RunContext, run_id: str) -> pl.DataFrame | None:
    """The eval set as load read it (kept in the work dir), or read again if the work dir is
    gone (a run finished by `collect` on another machine)."""
    kept = Path(ctx.work_root) / run_id / EVAL_FILE
    if kept.is_file():
        return pl.read_parquet(kept)
    return load_eval_set(ctx.job)


@task(name="qa", task_run_name="qa-{run_id}")
def qa_task(ctx: RunContext, run_id: str) -> dict:
    """The review sample and the eval scores; `hold` lists the eval gate's reasons to hold
    (accuracy drift or floor, or an eval set that got no answer)."""
    job, store = ctx.job, ctx.store
    gold = _gold(ctx, run_id) if job.qa.eval_set else None
    # every unit's answer (~100 MB at a million units) is read only when a sample or the eval
    # set looks at answers
    outcomes = (
        store.run_unit_outcomes(run_id) if job.qa.sample_rate > 0 or gold is not None else None
    )
    enums = list(job.enum_fields())
    sample = (
        no_sample()
        if outcomes is None
        else qa_sample(outcomes, job.qa.sample_rate, job.qa.seed, enums[0] if enums else None)
    )
    store.replace_rows("qa_samples", run_id, sample)
    result: dict = {"qa_samples": sample.height, "eval_accuracy": None, "hold": []}
    if gold is not None and outcomes is not None:
        result["hold"] = eval_unanswered(outcomes, gold)
        fields = [f for f in job.output_schema.get("properties", {}) if f in gold.columns]
        scores = eval_scores(outcomes, gold, fields, job.name)
        store.replace_rows("eval_scores", run_id, scores)
        if scores.height:
            result["eval_accuracy"] = float(scores["accuracy"].mean())  # type: ignore[arg-type]
            result["eval_by_field"] = dict(
                zip(scores["field"].to_list(), scores["accuracy"].to_list(), strict=True)
            )
            previous = store.previous_eval_scores(job.name, run_id)
            # with no answer, a drop in accuracy says nothing beyond the reason above
            result["hold"] = result["hold"] or eval_gate(
                scores,
                previous if previous.height else None,
                job.qa.eval_max_drop,
                job.qa.eval_floor,
            )
    stage_log(
        "qa",
        "%d units sampled for review, eval accuracy %s%s",
        sample.height,
        "n/a" if result["eval_accuracy"] is None else f"{result['eval_accuracy']:.1%}",
        f"; held: {'; '.join(result['hold'])}" if result["hold"] else "",
    )
    return result
