"""The human review round trip: export a run's QA sample to CSV, import the verdicts back.

The export has one row per sampled unit: ids, the source text and columns, every output field,
and empty `verdict` and `correct_value` columns for the reviewer. `verdict` is `correct` or
`incorrect` (blank: not reviewed); `correct_value` optionally says what the answer should have
been. Importing records the verdicts in `qa_samples` and the reviewed accuracy, with a 95%
Wilson interval, in `metrics`.
"""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl

from lowtide.store.publish import json_path, source_table
from lowtide.store.state import Store, _ident

VERDICTS = ("correct", "incorrect")


class ReviewFileError(ValueError):
    """A review file that cannot be imported; the message names the file, row and fix."""


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (sane at small n and at 0% or 100%)."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def export_sample(store: Store, run_id: str, out: Path) -> int:
    run = store.get_run(run_id)
    if run is None:
        raise LookupError(f"no run {run_id!r} in the state file")
    view = next((v for v in store.job_views() if v["job"] == run["job"]), None)
    if view is None:
        raise LookupError(f"job {run['job']!r} is not in the state file")
    fields = list(view["schema"].get("properties", {}))
    src = source_table(view["view"])
    taken = set(store.query(f"SELECT * FROM {_ident(src)} LIMIT 0").columns) | {
        "run_id",
        "unit_id",
        "verdict",
        "correct_value",
        view["id_column"],
    }
    # an output field named like a source column is exported as output_<field>
    extracted = ", ".join(
        f"json_extract_string(q.output, {json_path(f)}) AS "
        + _ident(f if f not in taken else f"output_{f}")
        for f in fields
    )
    sample = store.query(
        f"""
        SELECT q.run_id, q.unit_id, q.source_id AS {_ident(view["id_column"])},
               s.* EXCLUDE (run_id, source_id),
               {extracted}, '' AS verdict, '' AS correct_value
        FROM qa_samples q JOIN {_ident(src)} s
          ON s.run_id = q.run_id AND s.source_id = q.source_id
        WHERE q.run_id = ? ORDER BY q.unit_id
        """,
        [run_id],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    sample.write_csv(out)
    return sample.height


def import_verdicts(store: Store, path: Path) -> dict[str, dict[str, float]]:
    """Record the verdicts of a review file; returns reviewed accuracy per run."""
    if not path.is_file():
        raise ReviewFileError(f"{path}: file not found")
    try:
        review = pl.read_csv(path, infer_schema=False)
    except pl.exceptions.PolarsError as e:
        raise ReviewFileError(f"{path}: not a readable CSV: {e}") from e
    missing = {"run_id", "unit_id", "verdict", "correct_value"} - set(review.columns)
    if missing:
        raise ReviewFileError(
            f"{path}: missing column(s) {sorted(missing)}; import the file `lowtide qa export` wrote"
        )
    review = review.with_columns(
        pl.col("verdict").fill_null("").str.strip_chars().str.to_lowercase(),
        pl.col("correct_value").fill_null(""),
    ).with_row_index("row", offset=2)
    bad = review.filter(~pl.col("verdict").is_in(["", *VERDICTS]))
    if bad.height:
        first = bad.row(0, named=True)
        raise ReviewFileError(
            f"{path}: row {first['row']}: verdict {first['verdict']!r} is not one of "
            f"{', '.join(VERDICTS)} (or blank for not reviewed)"
        )
    known = store.query(
        "SELECT run_id, unit_id FROM qa_samples WHERE run_id IN (SELECT unnest(?::VARCHAR[]))",
        [review["run_id"].unique().to_list()],
    )
    unknown = review.join(known, on=["run_id", "unit_id"], how="anti")
    if unknown.height:
        first = unknown.row(0, named=True)
        raise ReviewFileError(
            f"{path}: row {first['row']}: unit {first['unit_id']!r} of run {first['run_id']!r} "
            "is not in that run's QA sample"
        )
    reviewed = review.filter(pl.col("verdict") != "").select(
        "run_id", "unit_id", "verdict", "correct_value"
    )
    with store.transaction() as con:
        con.register("incoming", reviewed)
        con.execute(
            "UPDATE qa_samples SET verdict = i.verdict, correct_value = nullif(i.correct_value, '') "
            "FROM incoming i WHERE qa_samples.run_id = i.run_id AND qa_samples.unit_id = i.unit_id"
        )
    summary: dict[str, dict[str, float]] = {}
    for run_id in reviewed["run_id"].unique().sort().to_list():
        stats = store.query(
            "SELECT count(*) FILTER (WHERE verdict = 'correct') AS correct, "
            "count(*) FILTER (WHERE verdict IN ('correct', 'incorrect')) AS n "
            "FROM qa_samples WHERE run_id = ?",
            [run_id],
        ).row(0, named=True)
        low, high = wilson_interval(stats["correct"], stats["n"])
        acc = stats["correct"] / stats["n"] if stats["n"] else 0.0
        values = {
            "qa_reviewed": float(stats["n"]),
            "qa_reviewed_accuracy": acc,
            "qa_accuracy_ci_low": low,
            "qa_accuracy_ci_high": high,
        }
        with store.transaction() as con:
            for name, value in values.items():
                con.execute(
                    "INSERT OR REPLACE INTO metrics VALUES (?, ?, ?)", [run_id, name, value]
                )
        summary[run_id] = values
    return summary
