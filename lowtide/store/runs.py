"""Jobs, runs and the lease: every run transition is one method here.

The run state machine (`lowtide.vocabulary.RunStatus`):

| from | to | method |
|---|---|---|
| (none) | running | `open_run` |
| running | failed | `fail_run` (refused before anything was sent) |
| running, submitted | failed | `finish_run` (every row failed: never published) |
| running, submitted | submitted | `mark_submitted` (never overwrites cancelling) |
| running, submitted | cancelling | `mark_cancelling`; `mark_switched` (a `[route]` step, `store/route.py`) |
| running, submitted, cancelling | completed, held, cancelled | `finish_run` |
| held, completed, cancelled | (published) | `publish_run` (held becomes completed) |
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import duckdb
import orjson
import polars as pl

from lowtide.errors import RunNotFoundError, RunStateError
from lowtide.store._db import Database
from lowtide.store.in_flight import IN_FLIGHT_WHERE, in_flight_statuses
from lowtide.vocabulary import FINISHED_RUN, RESUMABLE_RUN, RunStatus, sql_list


def now() -> datetime:
    """The store's clock: naive UTC, as DuckDB's TIMESTAMP columns hold it."""
    return datetime.now(UTC).replace(tzinfo=None)


_RESUMABLE_SQL = (
    "SELECT run_id FROM runs WHERE job = ? AND job_fingerprint = ? "
    "AND input_fingerprint IS NOT DISTINCT FROM ? AND backend = ? "
    "AND route_step IS NULL "  # a [route]'s step is resumed by its route (`store/route.py`)
    "AND (list_contains(?, status) OR status = ? AND published_at IS NULL) "
    "ORDER BY started_at DESC LIMIT 1"
)


def _insert_run(con: Any, run: Mapping[str, str | None]) -> None:
    con.execute(
        "INSERT INTO runs (run_id, job, job_fingerprint, job_file, backend, model, status, "
        "started_at, input_fingerprint, input_digest, spec_digest) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            run["run_id"],
            run["job"],
            run["job_fingerprint"],
            run["job_file"],
            run["backend"],
            run["model"],
            RunStatus.RUNNING.value,
            now(),
            run["input_fingerprint"],
            run.get("input_digest"),
            run.get("spec_digest"),
        ],
    )


def _resumable_params(job: str, fingerprint: str, inputs: str, backend: str) -> list[Any]:
    return [job, fingerprint, inputs, backend, sql_list(RESUMABLE_RUN), RunStatus.COMPLETED.value]


def job_views_in(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Every job's view definition inputs in the database `con` has open (the state file, or a
    copy of it being published)."""
    rows = con.execute(
        "SELECT job, view_name, id_column, output_schema, reduce FROM jobs ORDER BY job"
    ).fetchall()
    return [
        {
            "job": job,
            "view": view,
            "id_column": id_column,
            "schema": orjson.loads(schema),
            "reduce": orjson.loads(reduce or "{}"),
        }
        for job, view, id_column, schema, reduce in rows
    ]


class RunsStore(Database):
    # -- jobs ------------------------------------------------------------------------------------
    def save_job(
        self,
        job: str,
        view: str,
        id_column: str,
        schema: dict[str, Any],
        job_file: str,
        reduce: dict[str, str] | None = None,
    ) -> None:
        """What the job's views are built from: its id column, output schema and reduce rules."""
        with self._transaction() as con:
            con.execute(
                "INSERT OR REPLACE INTO jobs BY NAME SELECT ? AS job, ? AS view_name, "
                "? AS id_column, ? AS output_schema, ? AS job_file, now() AS updated_at, "
                "? AS reduce",
                [
                    job,
                    view,
                    id_column,
                    orjson.dumps(schema).decode(),
                    job_file,
                    orjson.dumps(reduce or {}).decode(),
                ],
            )

    def job_views(self) -> list[dict[str, Any]]:
        """Every job's view definition inputs, for publishing."""
        with self._connect() as con:
            return job_views_in(con)

    def job_view(self, job: str) -> dict[str, Any]:
        """One job's view definition; RunNotFoundError when the job was never run here."""
        view = next((v for v in self.job_views() if v["job"] == job), None)
        if view is None:
            raise RunNotFoundError(f"job {job!r} is not in the state file {self.path}")
        return view

    # -- reading runs ----------------------------------------------------------------------------
    def get_run(self, run_id: str) -> dict[str, Any] | None:
        df = self._query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        return df.row(0, named=True) if df.height else None

    def require_run(self, run_id: str) -> dict[str, Any]:
        """The run, or a RunNotFoundError naming the state file."""
        run = self.get_run(run_id)
        if run is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.path}")
        return run

    def run_status(self, run_id: str) -> RunStatus | None:
        status = self._scalar("SELECT status FROM runs WHERE run_id = ?", [run_id])
        return RunStatus(status) if status else None

    def list_runs(self, run_id: str | None = None) -> pl.DataFrame:
        return self._query(
            "SELECT * FROM runs WHERE ? IS NULL OR run_id = ? ORDER BY started_at DESC",
            [run_id, run_id],
        )

    def resumable_run(
        self, job: str, fingerprint: str, input_fingerprint: str, backend: str
    ) -> str | None:
        """The newest unfinished run of this job with the same job content and input on the
        same backend, if any (another backend's run is never driven, nor its answers published,
        by this one). A completed run whose publish never happened (a crash, a full disk) counts
        as unfinished: resuming it publishes it, and nothing is asked again."""
        return self._scalar(
            _RESUMABLE_SQL, _resumable_params(job, fingerprint, input_fingerprint, backend)
        )

    def in_flight_runs(self) -> list[dict[str, Any]]:
        """Runs that have batches and are not finished: what `collect` drives, oldest first."""
        return self._query(
            "SELECT run_id, job_file, backend, status, route_id, route_step, switched_at, "
            "(SELECT f.started_at FROM runs f WHERE f.run_id = r.route_id) AS route_started "
            f"FROM runs r WHERE {IN_FLIGHT_WHERE} ORDER BY started_at",
            [in_flight_statuses()],
        ).to_dicts()

    def latest_finished_runs(self, job: str | None = None) -> list[dict[str, Any]]:
        """The newest finished run of every job (or of one)."""
        return self._query(
            "SELECT * FROM runs WHERE finished_at IS NOT NULL AND (? IS NULL OR job = ?) "
            "QUALIFY row_number() OVER (PARTITION BY job ORDER BY started_at DESC) = 1 "
            "ORDER BY job",
            [job, job],
        ).to_dicts()

    # -- transitions -----------------------------------------------------------------------------
    def open_run(self, **run: str) -> None:
        """A new run in `running` (fields as `open_or_resume_run` takes them)."""
        with self._transaction() as con:
            _insert_run(con, run)

    def open_or_resume_run(
        self,
        *,
        run_id: str,
        job: str,
        job_fingerprint: str,
        job_file: str,
        backend: str,
        model: str,
        input_fingerprint: str,
        input_digest: str | None = None,
        spec_digest: str | None = None,
    ) -> str:
        """The run to drive: the resumable one (see `resumable_run`), else a new run `run_id` in
        `running`. One transaction, so two `lowtide run` started together (the file lock makes
        them take turns) resume one run rather than each starting one and paying twice."""
        params = _resumable_params(job, job_fingerprint, input_fingerprint, backend)
        with self._transaction() as con:
            found = con.execute(_RESUMABLE_SQL, params).fetchall()
            if found:
                return str(found[0][0])
            _insert_run(
                con,
                {
                    "run_id": run_id,
                    "job": job,
                    "job_fingerprint": job_fingerprint,
                    "job_file": job_file,
                    "backend": backend,
                    "model": model,
                    "input_fingerprint": input_fingerprint,
                    "input_digest": input_digest,
                    "spec_digest": spec_digest,
                },
            )
        return run_id

    def record_prepared(
        self,
        run_id: str,
        *,
        rows: int,
        units: int,
        unique_requests: int,
        cache_hits: int,
        carried_from: str | None = None,
        rows_carried: int = 0,
        spec_digest: str | None = None,
        units_recipe: str | None = None,
    ) -> None:
        """The run's counts, written before the manifest so a crash leaves a countable run, with
        the job spec and units recipe its units were made under (a run resumed after the job
        file changed is prepared under the new spec)."""
        made_under = {"spec_digest": spec_digest, "units_recipe": units_recipe}
        self._update(
            "runs",
            "run_id",
            run_id,
            rows=rows,
            units=units,
            unique_requests=unique_requests,
            cache_hits=cache_hits,
            requests_sent=0,
            carried_from=carried_from,
            rows_carried=rows_carried,
            **{k: v for k, v in made_under.items() if v is not None},
        )

    def record_estimate(self, run_id: str, estimate_usd: float | None) -> None:
        self._update("runs", "run_id", run_id, estimate_usd=estimate_usd)

    def record_error(self, run_id: str, error: str) -> None:
        """Keep the last error on a run that stays resumable."""
        self._update("runs", "run_id", run_id, error=error[:2000])

    def fail_run(self, run_id: str, error: str) -> None:
        """running → failed: refused before anything was sent (budget, bad input)."""
        self._update(
            "runs",
            "run_id",
            run_id,
            status=RunStatus.FAILED.value,
            error=error[:2000],
            finished_at=now(),
        )

    def mark_submitted(self, run_id: str) -> None:
        """running | submitted → submitted, with the count of requests sent so far; a run being
        cancelled stays cancelling."""
        with self._transaction() as con:
            con.execute(
                "UPDATE runs SET requests_sent = (SELECT count(DISTINCT br.custom_id) "
                "FROM batch_requests br JOIN batches b USING (batch_id) WHERE b.run_id = ? "
                "AND b.sent_at IS NOT NULL), "
                "status = CASE WHEN list_contains(?, status) THEN ? ELSE status END "
                "WHERE run_id = ?",
                [run_id, sql_list(RESUMABLE_RUN), RunStatus.SUBMITTED.value, run_id],
            )

    def mark_cancelling(self, run_id: str) -> RunStatus:
        """An in-flight run → cancelling (so nothing starts another round); returns the status
        it had. RunStateError for a run that is not in flight."""
        status = self.run_status(run_id)
        if status is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.path}")
        if not status.in_flight:
            raise RunStateError(f"run {run_id} is {status}; only a run in flight can be cancelled")
        self._update("runs", "run_id", run_id, status=RunStatus.CANCELLING.value)
        return status

    def finish_run(
        self,
        run_id: str,
        *,
        hold_reasons: list[str],
        succeeded: int,
        failed: int,
        eval_accuracy: float | None,
        cost_usd: float,
        realtime_cost_usd: float,
        naive_cost_usd: float,
    ) -> RunStatus:
        """Every request ended: → cancelled (it was cancelling), failed (every row failed: never
        published), held (a gate gave reasons) or completed (published once the file is
        written: `mark_published`). Returns the new status."""
        current = self.run_status(run_id)
        error = None
        if current is RunStatus.CANCELLING:
            status = RunStatus.CANCELLED
        elif failed and not succeeded:
            status = RunStatus.FAILED  # nothing to show: the view keeps the last good run
            error = f"every row failed ({failed} of {failed}); nothing was published"
        elif hold_reasons:
            status = RunStatus.HELD  # results are kept; the job view keeps the last published
        else:
            status = RunStatus.COMPLETED
        finished = now()
        with self._transaction() as con:
            con.execute(
                "UPDATE runs SET status = ?, gate_note = ?, finished_at = ?, error = ?, "
                "succeeded = ?, failed = ?, eval_accuracy = ?, cost_usd = ?, "
                "realtime_cost_usd = ?, naive_cost_usd = ?, "
                "requests_sent = (SELECT count(DISTINCT br.custom_id) FROM batch_requests br "
                "JOIN batches b USING (batch_id) WHERE b.run_id = ? AND b.sent_at IS NOT NULL) "
                "WHERE run_id = ?",
                [
                    status.value,
                    None if error else "; ".join(hold_reasons) or None,
                    finished,
                    error,
                    succeeded,
                    failed,
                    eval_accuracy,
                    cost_usd,
                    realtime_cost_usd,
                    naive_cost_usd,
                    run_id,
                    run_id,
                ],
            )
        return status

    def mark_published(self, run_id: str) -> None:
        """The published file now shows the run: only after the file was swapped in, so a crash
        or a failed write before that leaves a completed run that a rerun publishes."""
        self._update("runs", "run_id", run_id, published_at=now(), error=None)

    def publish_run(self, run_id: str) -> RunStatus:
        """A finished run becomes the one its job view shows (held → completed); call once its
        file is written (`publish(db, showing=run_id)`)."""
        new = self.publishable(run_id)
        self._update("runs", "run_id", run_id, status=new.value, published_at=now(), error=None)
        return new

    def publishable(self, run_id: str) -> RunStatus:
        """The status a finished run takes when published; RunStateError when it is not
        finished."""
        status = self.run_status(run_id)
        if status is None:
            raise RunNotFoundError(f"no run {run_id!r} in {self.path}")
        if status is RunStatus.FAILED:
            raise RunStateError(
                f"run {run_id} failed; a failed run is never published (its reason: "
                f"`lowtide status {run_id}`): fix the cause and run the job again"
            )
        if status not in FINISHED_RUN:
            raise RunStateError(f"run {run_id} is {status}; only a finished run can be published")
        return RunStatus.COMPLETED if status is RunStatus.HELD else status

    # -- the lease -------------------------------------------------------------------------------
    def claim_run(self, run_id: str, owner: str, lease_s: float) -> str | None:
        """Take (or renew) the lease on a run. Returns None when `owner` now holds it, else the
        live holder."""
        from lowtide.lease import owner_gone

        with self._transaction() as con:
            rows = con.execute(
                "SELECT lease_owner, lease_until < now()::TIMESTAMP FROM runs WHERE run_id = ?",
                [run_id],
            ).fetchall()
            holder, expired = rows[0] if rows else (None, True)
            if holder and holder != owner and not expired and not owner_gone(holder):
                return holder
            con.execute(
                "UPDATE runs SET lease_owner = ?, "
                "lease_until = now()::TIMESTAMP + to_seconds(?::DOUBLE) WHERE run_id = ?",
                [owner, lease_s, run_id],
            )
        return None

    def release_run(self, run_id: str, owner: str) -> None:
        with self._transaction() as con:
            con.execute(
                "UPDATE runs SET lease_owner = NULL, lease_until = NULL "
                "WHERE run_id = ? AND lease_owner = ?",
                [run_id, owner],
            )
