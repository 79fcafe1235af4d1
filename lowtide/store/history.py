"""A job's history across runs: what the charts of `lowtide report` and the run report show.

One question, "how did this job's last N finished runs go", answered as three frames, oldest run
first: from the state file (`Store.job_history`) or, read-only, from a published file, which
holds copies of the same tables (`published_history`). Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from lowtide.errors import RunNotFoundError, UserError
from lowtide.interrupts import kept_through_duckdb
from lowtide.store._db import Database, frame
from lowtide.vocabulary import FINISHED_RUN, sql_list

Query = Callable[[str, dict[str, Any]], pl.DataFrame]

HISTORY_RUNS = 20
"""How many finished runs a report shows by default."""

# The job's last $n finished runs (completed, held, cancelled), newest first; the callers order
# them oldest first. A run refused before anything was sent (failed) has no cost to chart.
_LAST_RUNS = (
    "SELECT run_id FROM runs WHERE job = $job AND list_contains($finished, status) "
    "ORDER BY started_at DESC, run_id DESC LIMIT $n"
)


@dataclass(frozen=True)
class JobHistory:
    """A job's last finished runs, oldest first.

    - `runs`: one row per run: `run_id`, `started_at`, `status`, `backend`, `model`, `rows`,
      `succeeded`, `failed`, `units`, `unique_requests`, `cache_hits`, `requests_sent`,
      `cost_usd` (billed), `realtime_cost_usd` (the billed tokens at realtime list price),
      `naive_cost_usd` (realtime, no dedupe, no cache), `batch_savings_usd`,
      `dedupe_savings_usd`, `cache_savings_usd` (0.0 where a run recorded none);
    - `evals`: `run_id`, `field`, `accuracy`, `n` for every scored output field of those runs;
    - `failures`: `run_id`, `reason`, `rows`: failed input rows by reason (runs without a
      failure have no row).
    """

    job: str
    runs: pl.DataFrame
    evals: pl.DataFrame
    failures: pl.DataFrame


class HistoryStore(Database):
    def job_history(self, job: str, last_runs: int = HISTORY_RUNS) -> JobHistory:
        """The job's last `last_runs` finished runs with their costs, savings, eval scores and
        failures; RunNotFoundError (naming the jobs that have runs) when it has none here."""
        return read_history(self._query, job, last_runs, self.path)


def published_history(db: Path, job: str, last_runs: int = HISTORY_RUNS) -> JobHistory:
    """`Store.job_history`, read from a published file (read-only, as an analyst reads it)."""
    if not db.is_file():
        raise UserError(f"{db}: no published file; run a job first or give --db the right path")
    con = duckdb.connect(str(db), read_only=True)
    try:
        with kept_through_duckdb():
            return read_history(lambda sql, params: frame(con, sql, params), job, last_runs, db)
    except duckdb.CatalogException as e:
        raise UserError(f"{db}: not a lowtide published file ({e})") from e
    finally:
        con.close()


def read_history(query: Query, job: str, last_runs: int, where: Path) -> JobHistory:
    """The three frames of `JobHistory`, asked through `query` (SQL, named parameters)."""
    params = {"job": job, "finished": sql_list(FINISHED_RUN), "n": last_runs}
    runs = query(
        f"""
        SELECT r.run_id, r.started_at, r.status, r.backend, r.model, r.rows, r.succeeded,
               r.failed, r.units, r.unique_requests, r.cache_hits, r.requests_sent,
               coalesce(r.cost_usd, 0.0) AS cost_usd,
               coalesce(r.realtime_cost_usd, 0.0) AS realtime_cost_usd,
               coalesce(r.naive_cost_usd, 0.0) AS naive_cost_usd,
               coalesce(max(m.value) FILTER (WHERE m.name = 'batch_savings_usd'), 0.0)
                   AS batch_savings_usd,
               coalesce(max(m.value) FILTER (WHERE m.name = 'dedupe_savings_usd'), 0.0)
                   AS dedupe_savings_usd,
               coalesce(max(m.value) FILTER (WHERE m.name = 'cache_savings_usd'), 0.0)
                   AS cache_savings_usd
        FROM runs r LEFT JOIN metrics m USING (run_id)
        WHERE r.run_id IN ({_LAST_RUNS})
        GROUP BY ALL ORDER BY r.started_at, r.run_id
        """,
        params,
    )
    if not runs.height:
        known = query("SELECT DISTINCT job FROM runs ORDER BY job", {})["job"].to_list()
        raise RunNotFoundError(
            f"no finished run of job {job!r} in {where}; "
            + (f"jobs with runs: {', '.join(known)}" if known else "run a job first")
        )
    evals = query(
        f"""
        SELECT e.run_id, e.field, e.accuracy, e.n FROM eval_scores e JOIN runs r USING (run_id)
        WHERE e.run_id IN ({_LAST_RUNS}) ORDER BY r.started_at, r.run_id, e.field
        """,
        params,
    )
    failures = query(
        f"""
        SELECT f.run_id, f.reason, count(*) AS rows FROM failures f JOIN runs r USING (run_id)
        WHERE f.kind = 'row' AND f.run_id IN ({_LAST_RUNS})
        GROUP BY f.run_id, r.started_at, f.reason ORDER BY r.started_at, f.run_id, rows DESC
        """,
        params,
    )
    return JobHistory(job, runs, evals, failures)
