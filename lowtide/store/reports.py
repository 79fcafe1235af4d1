"""Read models: what `lowtide status`, the run summary, the reports and the exports show.

Each method answers one question about the state file and returns plain values or a frame;
none of them writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from lowtide.errors import UserError
from lowtide.store._sql import ident, json_path, literal
from lowtide.store.provider_items import ProviderItemsStore
from lowtide.store.publish import PublishingStore, job_rows_sql
from lowtide.store.route import RouteStore
from lowtide.store.sources import source_table, table_columns
from lowtide.vocabulary import ANSWERED

_COPY_FORMAT = {
    "parquet": "(FORMAT parquet)",
    "csv": "(FORMAT csv, HEADER)",
    "jsonl": "(FORMAT json)",
}
EXPORT_FORMATS = tuple(_COPY_FORMAT)


class ReportsStore(PublishingStore, RouteStore, ProviderItemsStore):
    def source_columns(self, table: str) -> list[str]:
        """The columns of a job's sources table (empty when it does not exist yet)."""
        with self._connect() as con:
            return table_columns(con, table)

    def run_tokens(self, run_id: str) -> dict[str, int]:
        """Tokens the run was billed for: input, cached input, output."""
        return self._query(
            "SELECT coalesce(sum(input_tokens), 0) AS input_tokens, "
            "coalesce(sum(cached_tokens), 0) AS cached_tokens, "
            "coalesce(sum(output_tokens), 0) AS output_tokens FROM costs "
            "WHERE run_id = ? AND level = 'run'",
            [run_id],
        ).row(0, named=True)

    def run_metrics(self, run_id: str) -> dict[str, float | None]:
        rows = self._query("SELECT name, value FROM metrics WHERE run_id = ?", [run_id])
        return dict(rows.iter_rows())

    def failures_by_reason(self, run_id: str) -> dict[str, int]:
        """Failed input rows (not eval units) of the run, counted by reason, largest first."""
        rows = self._query(
            "SELECT reason, count(*) AS n FROM failures WHERE run_id = ? AND kind = 'row' "
            "GROUP BY 1 ORDER BY 2 DESC",
            [run_id],
        )
        return dict(rows.iter_rows())

    def main_failure(self, run_id: str) -> dict[str, Any] | None:
        """The reason most failed input rows of the run share, with its most frequent detail
        and how many rows it took ({reason, detail, rows}); None when no row failed."""
        rows = self._query(
            "SELECT reason, detail, sum(count(*)) OVER (PARTITION BY reason) AS rows "
            "FROM failures WHERE run_id = ? AND kind = 'row' GROUP BY reason, detail "
            "ORDER BY rows DESC, count(*) DESC, reason, detail NULLS LAST LIMIT 1",
            [run_id],
        )
        if not rows.height:
            return None
        top = rows.row(0, named=True)
        return {**top, "rows": int(top["rows"])}

    def eval_by_field(self, run_id: str) -> dict[str, float | None]:
        rows = self._query(
            "SELECT field, accuracy FROM eval_scores WHERE run_id = ? ORDER BY field", [run_id]
        )
        return dict(rows.iter_rows())

    def previous_eval_scores(self, job: str, run_id: str) -> pl.DataFrame:
        """(field, accuracy) of the job's last published run other than `run_id`; empty when
        there is none. The eval gate compares against this."""
        return self._query(
            "SELECT field, accuracy FROM eval_scores WHERE run_id = (SELECT run_id FROM runs "
            "WHERE job = ? AND published_at IS NOT NULL AND run_id <> ? "
            "ORDER BY published_at DESC LIMIT 1) ORDER BY field",
            [job, run_id],
        )

    def unit_counts(self, run_id: str) -> dict[str, int]:
        """Row units answered by the cache, eval units, and the QA sample's size."""
        return self._query(
            "SELECT count(*) FILTER (WHERE kind = 'row' AND cache_hit) AS row_units_cached, "
            "count(*) FILTER (WHERE kind = 'eval') AS eval_units, "
            "(SELECT count(*) FROM qa_samples WHERE run_id = $run) AS qa_samples "
            "FROM units WHERE run_id = $run",
            {"run": run_id},
        ).row(0, named=True)

    def answer_origins(self, run_id: str | None = None) -> dict[str, dict[str, dict[str, int]]]:
        """Where runs' answers came from, by the engine that gave them (`results.engine`:
        `emulator`, or `<family>:<model>`): run_id → {"cached_from": engine → requests the
        cache answered (its `cache_hits`), "answered_by": engine → answers the run received}.
        One run, or every run when `run_id` is None; a run without any has empty maps."""
        rows = self._query(
            """
            SELECT u.run_id, 'cached_from' AS side, coalesce(r.engine, 'unknown') AS engine,
                   count(DISTINCT u.custom_id) AS n
            FROM units u JOIN results r USING (custom_id)
            WHERE u.cache_hit AND ($run IS NULL OR u.run_id = $run)
            GROUP BY ALL
            UNION ALL
            SELECT run_id, 'answered_by', coalesce(engine, 'unknown'), count(*)
            FROM results
            WHERE list_contains($answered, outcome) AND ($run IS NULL OR run_id = $run)
            GROUP BY ALL
            ORDER BY 1, 2, 4 DESC, 3
            """,
            {"run": run_id, "answered": list(ANSWERED)},
        )
        out: dict[str, dict[str, dict[str, int]]] = {}
        for run, side, engine, n in rows.iter_rows():
            out.setdefault(run, {"cached_from": {}, "answered_by": {}})[side][engine] = int(n)
        return out

    def run_summary(self, run_id: str) -> dict[str, Any]:
        """Everything a person or a script wants to know about a run, as plain values."""
        run = self.require_run(run_id)
        return {
            **{k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in run.items()},
            **self.run_tokens(run_id),
            **self.unit_counts(run_id),
            "metrics": self.run_metrics(run_id),
            "failures_by_reason": self.failures_by_reason(run_id),
            "main_failure": self.main_failure(run_id),
            "eval_by_field": self.eval_by_field(run_id),
            "eval_previous_by_field": dict(
                self.previous_eval_scores(run["job"], run_id).iter_rows()
            ),
            **self.answer_origins(run_id).get(run_id, {"cached_from": {}, "answered_by": {}}),
        }

    def status_records(self, run_id: str | None, fields: tuple[str, ...]) -> list[dict[str, Any]]:
        """Runs (newest first) with the given fields, each with its `batches` and `metrics`."""
        runs = self.list_runs(run_id)
        params = {"run": run_id}
        batches = self._query(
            "SELECT run_id, batch_id, status, provider_batch_id, n_requests, request_counts "
            "FROM batches WHERE $run IS NULL OR run_id = $run ORDER BY run_id, shard, attempt",
            params,
        )
        metrics = self._query(
            "SELECT run_id, name, value FROM metrics WHERE $run IS NULL OR run_id = $run "
            "ORDER BY run_id, name",
            params,
        )
        origins = self.answer_origins(run_id)
        left = self.left_at_provider(run_id)
        records = []
        for r in runs.iter_rows(named=True):
            rec = {k: r.get(k) for k in fields}
            rec["batches"] = [
                b for b in batches.iter_rows(named=True) if b["run_id"] == r["run_id"]
            ]
            rec["metrics"] = {
                m["name"]: m["value"]
                for m in metrics.iter_rows(named=True)
                if m["run_id"] == r["run_id"]
            }
            rec.update(origins.get(r["run_id"], {"cached_from": {}, "answered_by": {}}))
            rec["left_at_provider"] = left.get(r["run_id"], {"count": 0, "bytes": 0})
            if r.get("route_id"):  # a route's step: what switching engines cost so far
                rec["paid_twice"] = self.paid_twice(r["route_id"])
            records.append(rec)
        return records

    def eval_trend(self, job: str, last_runs: int) -> pl.DataFrame:
        """(run_id, started_at, field, accuracy) of the job's last finished runs, oldest first."""
        return self._query(
            "SELECT r.run_id, r.started_at, e.field, e.accuracy FROM eval_scores e "
            "JOIN runs r USING (run_id) WHERE e.job = $job AND r.run_id IN (SELECT run_id "
            "FROM runs WHERE job = $job AND finished_at IS NOT NULL "
            "ORDER BY started_at DESC LIMIT $n) ORDER BY r.started_at, e.field",
            {"job": job, "n": last_runs},
        )

    def qa_sample_rows(self, run_id: str) -> pl.DataFrame:
        """The run's QA sample for a reviewer: ids, source columns, every output field (named
        output_<field> where a source column has the name) and empty verdict columns."""
        run = self.require_run(run_id)
        view = self.job_view(run["job"])
        src = source_table(view["view"])
        taken = set(self.source_columns(src)) | {
            "run_id",
            "unit_id",
            "verdict",
            "correct_value",
            view["id_column"],
        }
        extracted = ", ".join(
            f"json_extract_string(q.output, {json_path(f)}) AS "
            + ident(f if f not in taken else f"output_{f}")
            for f in view["schema"].get("properties", {})
        )
        return self._query(
            f"""
            SELECT q.run_id, q.unit_id, q.source_id AS {ident(view["id_column"])},
                   s.* EXCLUDE (run_id, source_id),
                   {extracted}, '' AS verdict, '' AS correct_value
            FROM qa_samples q JOIN {ident(src)} s
              ON s.run_id = q.run_id AND s.source_id = q.source_id
            WHERE q.run_id = ? ORDER BY q.unit_id
            """,
            [run_id],
        )

    def export_run(self, run_id: str, target: Path, fmt: str) -> int:
        """Write the run's rows, as the job view shows them, to `target`; returns the count."""
        run = self.require_run(run_id)
        view = self.job_view(run["job"])
        sql = job_rows_sql(
            view["job"],
            source_table(view["view"]),
            view["id_column"],
            view["schema"],
            run_id,
            view["reduce"],
        )
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as con:
                con.execute(f"COPY ({sql}) TO {literal(str(target))} {_COPY_FORMAT[fmt]}")
                return int(con.execute(f"SELECT count(*) FROM ({sql})").fetchall()[0][0])
        except (duckdb.Error, OSError) as e:
            # the export target is at fault here, not the state file
            raise UserError(f"{target}: cannot write the export: {' '.join(str(e).split())}") from e

    def observed_output_tokens(self, job: str) -> dict[str, Any]:
        """Output tokens the provider billed per request in the job's earlier runs (every result
        with a token count, re-asks included): `mean` (None without any), `requests`, `runs`."""
        return self._query(
            "SELECT avg(r.output_tokens)::DOUBLE AS mean, count(*) AS requests, "
            "count(DISTINCT r.run_id) AS runs FROM results r JOIN requests q USING (custom_id) "
            "WHERE q.job = ? AND r.output_tokens IS NOT NULL AND r.output_tokens > 0",
            [job],
        ).row(0, named=True)
