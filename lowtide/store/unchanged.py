"""The night nothing changed: a run recorded from the run its job view already shows.

A scheduled job over an unchanged table would otherwise re-read, re-chunk and re-hash every row
to learn that every answer is cached. When the shown run was made from the same job spec, the
same backend and model, and the same input (same file identity, or the same bytes), and left no
row unit to ask again, the new run is written as `completed` with `unchanged_from` naming that
run: it asks nothing, stores no units, and the view keeps showing the same rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb

from lowtide.store._sql import literal
from lowtide.store.runs import RunsStore, now
from lowtide.vocabulary import ANSWERED, RunStatus

_COPIED = (
    "job_fingerprint",
    "backend",
    "model",
    "rows",
    "units",
    "unique_requests",
    "succeeded",
    "failed",
    "eval_accuracy",
    "input_digest",
    "spec_digest",
)


class UnchangedStore(RunsStore):
    def shown_run(self, job: str) -> dict[str, Any] | None:
        """The run the job's view shows (newest published, completed), with `rows_run`: the run
        whose units it shows."""
        found = self._query(
            "SELECT *, coalesce(unchanged_from, run_id) AS rows_run FROM runs "
            "WHERE job = ? AND status = ? AND published_at IS NOT NULL "
            "ORDER BY started_at DESC LIMIT 1",
            [job, RunStatus.COMPLETED.value],
        ).to_dicts()
        return found[0] if found else None

    def row_units_left_to_ask(self, run_id: str) -> int:
        """Row units of the run that a rerun would ask again (no answer stored for them)."""
        return int(
            self._scalar(
                "SELECT count(*) FROM units u LEFT JOIN results r USING (custom_id) "
                "WHERE u.run_id = ? AND u.kind = 'row' AND u.custom_id <> '' "
                "AND NOT coalesce(list_contains(?, r.outcome), false)",
                [run_id, list(ANSWERED)],
            )
        )

    def record_unchanged(
        self, *, run_id: str, shown: dict[str, Any], job_file: str, input_fingerprint: str
    ) -> None:
        """A completed, published run that asked nothing and shows `shown`'s rows."""
        stamp = now()
        row = {k: shown[k] for k in _COPIED}
        row.update(
            run_id=run_id,
            job=shown["job"],
            job_file=job_file,
            status=RunStatus.COMPLETED.value,
            started_at=stamp,
            finished_at=stamp,
            published_at=stamp,
            input_fingerprint=input_fingerprint,
            unchanged_from=shown["rows_run"],
            cache_hits=shown["unique_requests"],
            requests_sent=0,
            estimate_usd=0.0,
            cost_usd=0.0,
            realtime_cost_usd=0.0,
            naive_cost_usd=0.0,
        )
        names = list(row)
        with self._transaction() as con:
            con.execute(
                f"INSERT INTO runs ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                list(row.values()),
            )

    def add_run_to_published(self, db_path: str | Path, run_id: str) -> bool:
        """Append the run's row to the published file's `runs` table in place (its views do not
        change: they show the same rows). False when that cannot be done (no file yet, a file
        from an older lowtide, a reader holding it): the caller then publishes in full."""
        db_path = Path(db_path)
        if not db_path.is_file():
            return False
        with self._connect() as con:
            try:
                con.execute(f"ATTACH {literal(str(db_path))} AS pub")
            except duckdb.Error:
                return False
            try:
                con.execute(
                    "INSERT INTO pub.runs BY NAME SELECT * FROM runs WHERE run_id = ?", [run_id]
                )
            except duckdb.Error:
                return False
            finally:
                con.execute("DETACH pub")
        return True
