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

from lowtide.errors import ReviewFileError
from lowtide.store import Store

VERDICTS = ("correct", "incorrect")


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
    """Write the run's QA sample for a reviewer as CSV; returns the row count."""
    sample = store.qa_sample_rows(run_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    sample.write_csv(out)
    return sample.height


def import_verdicts(store: Store, path: Path) -> dict[str, dict[str, float]]:
    """Record the verdicts of a review file; returns reviewed accuracy per run."""
    if not path.is_file():
        raise ReviewFileError(f"{path}: file not found")
    try:
        review = pl.read_csv(path, infer_schema=False, glob=False)  # a path, not a pattern
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
    reviewed = review.filter(pl.col("verdict") != "")
    twice = reviewed.filter(pl.len().over("run_id", "unit_id") > 1)
    if twice.height:
        first = twice.sort("row").row(0, named=True)
        rows = twice.filter(
            (pl.col("run_id") == first["run_id"]) & (pl.col("unit_id") == first["unit_id"])
        )["row"].to_list()
        raise ReviewFileError(
            f"{path}: rows {rows}: unit {first['unit_id']!r} of run {first['run_id']!r} is "
            "reviewed more than once; keep one verdict per unit"
        )
    known = store.qa_sample_keys(review["run_id"].unique().to_list())
    unknown = review.join(known, on=["run_id", "unit_id"], how="anti")
    if unknown.height:
        first = unknown.row(0, named=True)
        raise ReviewFileError(
            f"{path}: row {first['row']}: unit {first['unit_id']!r} of run {first['run_id']!r} "
            "is not in that run's QA sample"
        )
    reviewed = reviewed.select("run_id", "unit_id", "verdict", "correct_value")
    store.record_verdicts(reviewed)
    summary: dict[str, dict[str, float]] = {}
    for run_id in reviewed["run_id"].unique().sort().to_list():
        stats = store.review_counts(run_id)
        low, high = wilson_interval(stats["correct"], stats["n"])
        acc = stats["correct"] / stats["n"] if stats["n"] else 0.0
        values = {
            "qa_reviewed": float(stats["n"]),
            "qa_reviewed_accuracy": acc,
            "qa_accuracy_ci_low": low,
            "qa_accuracy_ci_high": high,
        }
        store.set_metrics(run_id, values)
        summary[run_id] = values
    return summary
