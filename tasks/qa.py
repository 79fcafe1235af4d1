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


def sample_mask(unit_ids: pl.Series, rate: float, seed: int) -> pl.Series:
    """True for the units in the sample: md5(seed:unit_id) read as a fraction below `rate`."""
    con = duckdb.connect()
    try:
        con.register("u", pl.DataFrame({"unit_id": unit_ids}))
        picked = con.sql(
            "SELECT (('0x' || substr(md5(?::VARCHAR || ':' || unit_id), 1, 8))::BIGINT "
            "/ 4294967296.0) < ? AS keep FROM u",
            params=[str(seed), rate],
        ).to_arrow_table()
    finally:
        con.close()
    return pl.Series("keep", picked.column("keep").to_pylist(), dtype=pl.Boolean)


def qa_sample(outcomes: pl.DataFrame, rate: float, seed: int) -> pl.DataFrame:
    rows = outcomes.filter((pl.col("kind") == "row") & pl.col("outcome").is_in(ANSWERED))
    if rows.is_empty() or rate <= 0:
        return pl.DataFrame(
            schema={"unit_id": pl.String, "source_id": pl.String, "output": pl.String}
        )
    return rows.filter(sample_mask(rows["unit_id"], rate, seed)).select(
        "unit_id", "source_id", "output"
    )


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


@task(name="qa", task_run_name="qa-{run_id}")
def qa_task(job: JobSpec, run_id: str, state_path: str, eval_path: str | None) -> dict:
    store = Store(state_path)
    outcomes = store.run_unit_outcomes(run_id)
    sample = qa_sample(outcomes, job.qa.sample_rate, job.qa.seed)
    store.replace_rows("qa_samples", run_id, sample)
    result: dict = {"qa_samples": sample.height, "eval_accuracy": None}
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
    return result
