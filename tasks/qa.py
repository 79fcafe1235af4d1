"""qa: a deterministic review sample of the run's outputs, and the eval set scored.

The sample is chosen by a hash of (seed, unit_id), so the same job and seed always pick the same
units, whatever the order or size of the input. Eval units are answered in the same batches as
the rows and compared field by field with the gold labels.
"""

from __future__ import annotations

import duckdb
import orjson
import polars as pl
from prefect import task

from lowtide.jobspec import JobSpec
from lowtide.store.state import ANSWERED, Store


def sample_order(unit_ids: pl.Series, seed: int) -> pl.Series:
    """A stable pseudo-random rank key per unit: md5(seed:unit_id) as a fraction in [0, 1)."""
    con = duckdb.connect()
    try:
        con.register("u", pl.DataFrame({"unit_id": unit_ids}, schema={"unit_id": pl.String}))
        keys = con.sql(
            "SELECT ('0x' || substr(md5(?::VARCHAR || ':' || unit_id), 1, 8))::BIGINT "
            "/ 4294967296.0 AS k FROM u",
            params=[str(seed)],
        ).to_arrow_table()
    finally:
        con.close()
    return pl.Series("k", keys.column("k").to_pylist(), dtype=pl.Float64)


def qa_sample(
    outcomes: pl.DataFrame, rate: float, seed: int, stratify_by: str | None = None
) -> pl.DataFrame:
    """The review sample: `rate` of the answered rows, the same for the same seed.

    With `stratify_by` (an enum output field), each label gets its share of the sample and at
    least one unit, so rare labels are reviewed too.
    """
    empty = pl.DataFrame(schema={"unit_id": pl.String, "source_id": pl.String, "output": pl.String})
    rows = outcomes.filter((pl.col("kind") == "row") & pl.col("outcome").is_in(ANSWERED))
    if rows.is_empty() or rate <= 0:
        return empty
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
    valid = joined["outcome"].is_in(ANSWERED).fill_null(False)
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
                "schema_valid_rate": float(valid.mean()) if n else None,
            }  # type: ignore[arg-type]
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


@task(name="qa", task_run_name="qa-{run_id}")
def qa_task(job: JobSpec, run_id: str, state_path: str, eval_path: str | None) -> dict:
    store = Store(state_path)
    outcomes = store.run_unit_outcomes(run_id)
    enums = list(job.enum_fields())
    sample = qa_sample(outcomes, job.qa.sample_rate, job.qa.seed, enums[0] if enums else None)
    store.replace_rows("qa_samples", run_id, sample)
    result: dict = {"qa_samples": sample.height, "eval_accuracy": None, "hold": []}
    if eval_path:
        gold = pl.read_parquet(eval_path)
        fields = [f for f in job.output_schema.get("properties", {}) if f in gold.columns]
        scores = eval_scores(outcomes, gold, fields, job.name)
        store.replace_rows("eval_scores", run_id, scores)
        if scores.height:
            result["eval_accuracy"] = float(scores["accuracy"].mean())  # type: ignore[arg-type]
            result["eval_by_field"] = dict(
                zip(scores["field"].to_list(), scores["accuracy"].to_list(), strict=True)
            )
            previous = store.query(
                "SELECT field, accuracy FROM eval_scores WHERE run_id = (SELECT run_id FROM runs "
                "WHERE job = ? AND published_at IS NOT NULL AND run_id <> ? "
                "ORDER BY published_at DESC LIMIT 1)",
                [job.name, run_id],
            )
            result["hold"] = eval_gate(
                scores,
                previous if previous.height else None,
                job.qa.eval_max_drop,
                job.qa.eval_floor,
            )
    return result
