"""Which runs a job's view shows: its newest published run, and for an incremental job the
published runs whose rows it merges. Read from whichever database holds the runs: the state
file, or the copy of it being published (whose views must name only runs the copy holds)."""

from __future__ import annotations

from typing import Any

import duckdb

from lowtide.store._sql import literal
from lowtide.store.runs import job_views_in


def shown_run_sql(job: str, showing: str | None = None) -> str:
    """The run a job's view shows: its newest published run by start (a run collected late
    never replaces a newer one already published), `showing` counting as published (the run
    being published now, marked so only once its file is written). A run that found its job
    and input unchanged shows the rows of the run it points to."""
    also = f" OR run_id = {literal(showing)}" if showing else ""
    return (
        f"SELECT coalesce(unchanged_from, run_id) AS run_id FROM runs WHERE job = {literal(job)} "
        f"AND (published_at IS NOT NULL{also}) ORDER BY started_at DESC LIMIT 1"
    )


def merged_runs_sql(job: str, showing: str | None = None) -> str:
    """The runs whose rows an incremental job's view merges (`[input] cursor_column`), oldest
    first: every published run (`showing` counting as published; a run recorded as unchanged
    stands for the run it points to) since the job's newest published completed run that read
    every row (no mark: its first, or one that started over). Empty when the job's shown run did
    not read with a cursor: such a job shows its one shown run."""
    also = f" OR run_id = {literal(showing)}" if showing else ""
    return f"""
    WITH pub AS (
        SELECT coalesce(unchanged_from, run_id) AS rows_run, started_at FROM runs
        WHERE job = {literal(job)} AND (published_at IS NOT NULL{also})
    ),
    shown AS (
        SELECT r.cursor_column FROM runs r
        WHERE r.run_id = (SELECT rows_run FROM pub ORDER BY started_at DESC LIMIT 1)
    ),
    base AS (
        SELECT max(pub.started_at) AS at FROM pub JOIN runs r ON r.run_id = pub.rows_run
        WHERE r.cursor_column IS NOT NULL AND r.cursor_from IS NULL
          AND r.status IN ('completed', 'held')  -- held: being published (it becomes completed)
    )
    SELECT pub.rows_run FROM pub, base
    WHERE (SELECT cursor_column FROM shown) IS NOT NULL
      AND pub.started_at >= coalesce(base.at, '-infinity'::TIMESTAMP)
    GROUP BY pub.rows_run ORDER BY max(pub.started_at)
    """


def views_runs(
    con: duckdb.DuckDBPyConnection, showing: str | None
) -> tuple[list[dict[str, Any]], dict[str, str | None], dict[str, list[str]]]:
    """Every job's view inputs in the database `con` has open, its shown run and its merged
    runs (`showing` counting as published)."""
    jobs = job_views_in(con)
    shown: dict[str, str | None] = {}
    merged: dict[str, list[str]] = {}
    for job in jobs:
        row = con.execute(shown_run_sql(job["job"], showing)).fetchone()
        shown[job["job"]] = row[0] if row else None
        merged[job["job"]] = [
            r[0] for r in con.execute(merged_runs_sql(job["job"], showing)).fetchall()
        ]
    return jobs, shown, merged
