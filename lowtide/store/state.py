"""The state file: every fact about every run, owned by this one module.

Only the flow's own process writes it, in short transactions: open, write, commit, close. Another
lowtide process holding the file is waited for (bounded), then reported by name and holder.
Everything row-level moves in and out as Arrow/polars frames, never row by row.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from lowtide.store import migrations

LINE_SQL = (
    "coalesce(q.line, t.head || '\"' || q.custom_id || '\"' || t.mid || "
    "to_json(q.user_message) || t.tail)"
)
"""A request's line: stored whole (re-asks), or rebuilt from its template and message."""

TERMINAL_BATCH = ("completed", "failed", "expired", "cancelled")
ANSWERED = ("ok", "repaired", "reasked")


class StateLockedError(RuntimeError):
    """Another process holds the state file for longer than we are willing to wait."""

    def __init__(self, path: Path, waited_s: float, detail: str):
        self.path = str(path)
        holder = re.search(r"held in (.*?)(?:\. See|$)", detail)
        who = holder.group(1) if holder else "another process"
        super().__init__(
            f"state file {path} is locked by {who}; waited {waited_s:.0f} s. "
            "Wait for that lowtide process to finish (or stop it), or point LOWTIDE_STATE elsewhere."
        )


def frame(
    con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None
) -> pl.DataFrame:
    """Run a query and return its result as a polars frame (through Arrow, no row loop)."""
    result = pl.from_arrow(con.sql(sql, params=params or None).to_arrow_table())
    assert isinstance(result, pl.DataFrame)
    return result


def sql_string(value: str) -> str:
    """A single-quoted SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Store:
    """All SQL against the state file. Each public method is one short transaction."""

    def __init__(self, path: str | Path, lock_timeout_s: float = 30.0):
        self.path = Path(path)
        self.lock_timeout_s = lock_timeout_s
        self._migrated = False

    # -- connection --------------------------------------------------------------------------
    @contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.05
        while True:
            try:
                con = duckdb.connect(str(self.path))
                break
            except duckdb.IOException as e:
                if "lock" not in str(e).lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StateLockedError(self.path, self.lock_timeout_s, str(e)) from e
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            if not self._migrated:
                migrations.apply(con)
                self._migrated = True
            yield con
        finally:
            con.close()

    @contextmanager
    def transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self.connect() as con:
            con.execute("BEGIN")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def query(self, sql: str, params: list[Any] | None = None) -> pl.DataFrame:
        with self.connect() as con:
            return frame(con, sql, params)

    def scalar(self, sql: str, params: list[Any] | None = None) -> Any:
        with self.connect() as con:
            rows = con.execute(sql, params or []).fetchall()
            return rows[0][0] if rows else None

    # -- jobs ----------------------------------------------------------------------------------
    def save_job(
        self, job: str, view: str, id_column: str, schema_json: str, job_file: str
    ) -> None:
        with self.transaction() as con:
            con.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, now())",
                [job, view, id_column, schema_json, job_file],
            )

    def job_views(self) -> list[dict[str, Any]]:
        """Every job's view definition inputs, for publishing."""
        import orjson

        jobs = self.query("SELECT * FROM jobs ORDER BY job")
        return [
            {
                "job": r["job"],
                "view": r["view_name"],
                "id_column": r["id_column"],
                "schema": orjson.loads(r["output_schema"]),
            }
            for r in jobs.iter_rows(named=True)
        ]

    # -- runs ----------------------------------------------------------------------------------
    def create_run(self, **fields: Any) -> None:
        cols = ", ".join(fields)
        marks = ", ".join("?" for _ in fields)
        with self.transaction() as con:
            con.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", list(fields.values()))

    def update_run(self, run_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction() as con:
            con.execute(f"UPDATE runs SET {sets} WHERE run_id = ?", [*fields.values(), run_id])

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        df = self.query("SELECT * FROM runs WHERE run_id = ?", [run_id])
        return df.row(0, named=True) if df.height else None

    def resumable_run(self, job: str, fingerprint: str, input_fingerprint: str) -> str | None:
        """The newest unfinished run of this job with the same job content and input, if any."""
        return self.scalar(
            "SELECT run_id FROM runs WHERE job = ? AND job_fingerprint = ? "
            "AND input_fingerprint IS NOT DISTINCT FROM ? "
            "AND status IN ('running', 'submitted') ORDER BY started_at DESC LIMIT 1",
            [job, fingerprint, input_fingerprint],
        )

    def claim_run(self, run_id: str, owner: str, lease_s: float) -> str | None:
        """Take (or renew) the lease on a run. Returns None when `owner` now holds it, else the
        live holder."""
        from lowtide.lease import owner_gone

        with self.transaction() as con:
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
        with self.transaction() as con:
            con.execute(
                "UPDATE runs SET lease_owner = NULL, lease_until = NULL "
                "WHERE run_id = ? AND lease_owner = ?",
                [run_id, owner],
            )

    def list_runs(self, run_id: str | None = None) -> pl.DataFrame:
        where = "WHERE run_id = ?" if run_id else ""
        return self.query(
            f"SELECT * FROM runs {where} ORDER BY started_at DESC", [run_id] if run_id else []
        )

    # -- sources and units -----------------------------------------------------------------------
    def save_sources(self, table: str, run_id: str, frame: pl.DataFrame) -> None:
        """Keep the run's input rows (typed) so the job view can show them next to outputs."""
        with self.transaction() as con:
            con.register("incoming", frame)
            con.execute(
                f"CREATE TABLE IF NOT EXISTS {_ident(table)} AS "
                "SELECT ?::VARCHAR AS run_id, * FROM incoming LIMIT 0",
                [run_id],
            )
            # an input that gained columns since earlier runs: widen the table (old rows: NULL)
            have = {
                r[0]
                for r in con.execute(
                    "SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [table]
                ).fetchall()
            }
            types = dict(
                con.execute("SELECT column_name, column_type FROM (DESCRIBE incoming)").fetchall()
            )
            for column in frame.columns:
                if column not in have:
                    con.execute(
                        f"ALTER TABLE {_ident(table)} ADD COLUMN {_ident(column)} {types[column]}"
                    )
            con.execute(f"DELETE FROM {_ident(table)} WHERE run_id = ?", [run_id])
            con.execute(
                f"INSERT INTO {_ident(table)} BY NAME SELECT ?::VARCHAR AS run_id, * FROM incoming",
                [run_id],
            )

    def save_units(self, run_id: str, units: pl.DataFrame) -> None:
        with self.transaction() as con:
            con.register("incoming", units)
            con.execute("DELETE FROM units WHERE run_id = ?", [run_id])
            con.execute(
                "INSERT INTO units BY NAME SELECT ?::VARCHAR AS run_id, unit_id, source_id, kind, "
                "chunk_index, n_chunks, unit_tokens, custom_id, cache_hit FROM incoming",
                [run_id],
            )

    def known_outcomes(self, custom_ids: pl.Series) -> pl.DataFrame:
        """Which of these requests are already answered, or already in a live batch."""
        with self.connect() as con:
            con.register("wanted", pl.DataFrame({"custom_id": custom_ids}))
            return frame(
                con,
                f"""
                SELECT w.custom_id,
                       coalesce(r.outcome IN {ANSWERED}, false) AS answered,
                       EXISTS (SELECT 1 FROM batch_requests br JOIN batches b USING (batch_id)
                               JOIN runs ON runs.run_id = b.run_id
                               WHERE br.custom_id = w.custom_id
                                 AND runs.status IN ('running', 'submitted')
                                 AND (b.status NOT IN {TERMINAL_BATCH} OR NOT b.collected))
                           AS in_flight
                FROM wanted w LEFT JOIN results r USING (custom_id)
                """,
            )

    # -- manifest and batches --------------------------------------------------------------------
    def write_manifest(
        self, run_id: str, requests: pl.DataFrame, batches: pl.DataFrame, members: pl.DataFrame
    ) -> None:
        """Request lines and pending batch rows, committed together before anything is sent."""
        with self.transaction() as con:
            con.register("req", requests)
            con.register("bat", batches)
            con.register("mem", members)
            optional = "".join(
                f", {c}"
                for c in ("line", "user_message", "template_id", "reask_of")
                if c in requests.columns
            )
            con.execute(
                "INSERT OR IGNORE INTO requests BY NAME SELECT custom_id, request_key, job, model, "
                f"?::VARCHAR AS first_run_id, est_input_tokens, now() AS created_at{optional} "
                "FROM req",
                [run_id],
            )
            con.execute(
                "INSERT INTO batches BY NAME SELECT batch_id, ?::VARCHAR AS run_id, shard, attempt, "
                "backend, 'pending' AS status, n_requests, n_bytes, false AS collected, "
                "now() AS created_at, now() AS updated_at FROM bat",
                [run_id],
            )
            con.execute("INSERT OR IGNORE INTO batch_requests SELECT batch_id, custom_id FROM mem")

    def run_batches(self, run_id: str) -> pl.DataFrame:
        return self.query(
            "SELECT * FROM batches WHERE run_id = ? ORDER BY shard, attempt", [run_id]
        )

    def open_batches(self, run_id: str | None = None) -> pl.DataFrame:
        """Batches not yet collected (in any state), optionally for one run."""
        where = "AND run_id = ?" if run_id else ""
        return self.query(
            f"SELECT * FROM batches WHERE NOT collected {where} ORDER BY created_at, shard",
            [run_id] if run_id else [],
        )

    def update_batch(self, batch_id: str, **fields: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self.transaction() as con:
            con.execute(
                f"UPDATE batches SET {sets}, updated_at = now() WHERE batch_id = ?",
                [*fields.values(), batch_id],
            )

    def save_template(self, template_id: str, head: str, mid: str, tail: str) -> None:
        with self.transaction() as con:
            con.execute(
                "INSERT OR IGNORE INTO request_templates VALUES (?, ?, ?, ?)",
                [template_id, head, mid, tail],
            )

    def batch_lines(self, batch_id: str) -> list[str]:
        """The JSONL lines of a batch, exactly as they are sent, built in the database."""
        with self.connect() as con:
            rows = con.sql(
                f"SELECT {LINE_SQL} AS line FROM batch_requests br JOIN requests q USING (custom_id) "
                "LEFT JOIN request_templates t USING (template_id) "
                "WHERE br.batch_id = ? ORDER BY q.custom_id",
                params=[batch_id],
            ).to_arrow_table()
        return rows.column("line").to_pylist()

    def batch_members(self, batch_id: str) -> pl.DataFrame:
        return self.query("SELECT custom_id FROM batch_requests WHERE batch_id = ?", [batch_id])

    # -- results -----------------------------------------------------------------------------------
    def upsert_results(self, results: pl.DataFrame) -> None:
        """Insert or replace results by custom_id; a repeated download changes nothing.

        An answered request is never overwritten by a later failure of another attempt.
        """
        if results.is_empty():
            return
        with self.transaction() as con:
            con.register("incoming", results)
            con.execute(
                f"""
                INSERT OR REPLACE INTO results BY NAME
                SELECT i.*, now() AS received_at FROM incoming i
                LEFT JOIN results r USING (custom_id)
                WHERE r.custom_id IS NULL OR r.outcome NOT IN {ANSWERED}
                   OR i.outcome IN {ANSWERED} AND r.batch_id = i.batch_id
                """
            )

    def attempt_counts(self, custom_ids: pl.Series) -> pl.DataFrame:
        """(custom_id, attempts): how many batches (of any channel) each request was sent in."""
        with self.connect() as con:
            con.register("wanted", pl.DataFrame({"custom_id": custom_ids}))
            return frame(
                con,
                "SELECT br.custom_id, count(*)::INTEGER AS attempts FROM batch_requests br "
                "JOIN wanted USING (custom_id) GROUP BY 1",
            )

    def results_for(self, custom_ids: pl.Series) -> pl.DataFrame:
        with self.connect() as con:
            con.register("wanted", pl.DataFrame({"custom_id": custom_ids}))
            return frame(con, "SELECT r.* FROM results r JOIN wanted USING (custom_id)")

    def replace_rows(self, table: str, run_id: str, frame: pl.DataFrame) -> None:
        """Replace a run's rows in a per-run table (failures, qa_samples, eval_scores, costs, metrics)."""
        assert table in {"failures", "qa_samples", "eval_scores", "costs", "metrics"}
        with self.transaction() as con:
            con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
            if frame.height:
                con.register("incoming", frame)
                con.execute(
                    f"INSERT INTO {table} BY NAME SELECT ?::VARCHAR AS run_id, * FROM incoming",
                    [run_id],
                )

    def run_request_outcomes(self, run_id: str) -> pl.DataFrame:
        """Every request this run sent, with its outcome and how often it was tried."""
        return self.query(
            """
            WITH mine AS (
                SELECT DISTINCT br.custom_id FROM batch_requests br JOIN batches b USING (batch_id)
                WHERE b.run_id = ?
            ), tries AS (
                SELECT br.custom_id,
                       count(*) FILTER (WHERE b.backend <> 'realtime') AS batch_attempts,
                       count(*) FILTER (WHERE b.backend = 'realtime') AS realtime_attempts
                FROM batch_requests br JOIN batches b USING (batch_id)
                WHERE br.custom_id IN (SELECT custom_id FROM mine) GROUP BY 1
            )
            SELECT m.custom_id, r.outcome, r.error, r.finish_reason,
                   t.batch_attempts, t.realtime_attempts,
                   (q.reask_of IS NOT NULL
                    OR EXISTS (SELECT 1 FROM requests x WHERE x.reask_of = m.custom_id)) AS has_reask
            FROM mine m
            JOIN tries t USING (custom_id)
            LEFT JOIN results r USING (custom_id)
            LEFT JOIN requests q USING (custom_id)
            """,
            [run_id],
        )

    def request_lines(self, custom_ids: list[str]) -> pl.DataFrame:
        with self.connect() as con:
            con.register(
                "wanted", pl.DataFrame({"custom_id": custom_ids}, schema={"custom_id": pl.String})
            )
            return frame(
                con,
                f"SELECT q.custom_id, q.request_key, {LINE_SQL} AS line, q.est_input_tokens, "
                "r.error, r.finish_reason FROM requests q JOIN wanted USING (custom_id) "
                "LEFT JOIN request_templates t USING (template_id) "
                "LEFT JOIN results r USING (custom_id)",
            )

    def fold_reasks(self) -> None:
        """A re-ask's valid answer repairs the request it re-asked; a failed one adds its reason."""
        with self.transaction() as con:
            con.execute(
                f"""
                UPDATE results SET outcome = 'reasked', output = a.output, error = NULL
                FROM requests q JOIN results a ON a.custom_id = q.custom_id
                WHERE q.reask_of = results.custom_id AND a.outcome IN {ANSWERED}
                  AND results.outcome = 'parse_failed'
                """
            )
            con.execute(
                f"""
                UPDATE results SET error = results.error || '; re-ask: ' || coalesce(a.error, a.outcome)
                FROM requests q JOIN results a ON a.custom_id = q.custom_id
                WHERE q.reask_of = results.custom_id AND a.outcome NOT IN {ANSWERED}
                  AND results.outcome = 'parse_failed' AND results.error NOT LIKE '%; re-ask: %'
                """
            )

    def run_unit_outcomes(self, run_id: str) -> pl.DataFrame:
        """Every unit of a run with its request's outcome (null if not answered yet)."""
        return self.query(
            """
            SELECT u.unit_id, u.source_id, u.kind, u.chunk_index, u.n_chunks, u.unit_tokens,
                   u.custom_id,
                   u.cache_hit, r.outcome, r.output, r.error, r.batch_id, r.input_tokens,
                   r.cached_tokens, r.output_tokens, r.run_id AS answered_in_run
            FROM units u LEFT JOIN results r USING (custom_id)
            WHERE u.run_id = ?
            ORDER BY u.kind, u.source_id, u.chunk_index
            """,
            [run_id],
        )
