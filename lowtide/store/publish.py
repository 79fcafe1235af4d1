"""The published file: what analysts open.

It is rebuilt from the state file into a new file and renamed over the old one, so a reader sees
the previous or the next state, never half of one, and a reader holding the old file open blocks
nothing (it keeps reading the old inode).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import duckdb

from lowtide.store._sql import ident, json_path, literal, literal_list
from lowtide.store.runs import RunsStore
from lowtide.vocabulary import ANSWERED

PIPELINE_TABLES = (
    "schema_version",
    "runs",
    "units",
    "requests",
    "batches",
    "batch_requests",
    "results",
    "failures",
    "qa_samples",
    "eval_scores",
    "costs",
    "metrics",
)

_ANSWERED = literal_list(ANSWERED)
_SQL_TYPES = {"string": "VARCHAR", "integer": "BIGINT", "number": "DOUBLE", "boolean": "BOOLEAN"}


def _field_type(spec: dict[str, Any]) -> str:
    kind = spec.get("type", "string")
    if isinstance(kind, list):  # nullable union like ["string", "null"]
        kind = next((k for k in kind if k != "null"), "string")
    return _SQL_TYPES.get(kind, "JSON")


def job_rows_sql(
    job: str, src_table: str, id_column: str, schema: dict[str, Any], run_id: str | None = None
) -> str:
    """One row per unit of a run (default: the job's latest published run): source columns,
    then the output schema's fields as typed columns."""
    fields = []
    for name, spec in schema.get("properties", {}).items():
        sql_type = _field_type(spec if isinstance(spec, dict) else {})
        path = json_path(name)
        if sql_type == "JSON":
            fields.append(f"json_extract(r.output, {path}) AS {ident(name)}")
        else:
            fields.append(
                f"TRY_CAST(json_extract_string(r.output, {path}) AS {sql_type}) AS {ident(name)}"
            )
    outputs = ",\n       ".join(fields)
    if run_id is None:
        chosen = (
            f"SELECT run_id FROM runs WHERE job = {literal(job)} AND published_at IS NOT NULL "
            "ORDER BY published_at DESC LIMIT 1"
        )
    else:
        chosen = f"SELECT {literal(run_id)} AS run_id"
    return f"""
WITH chosen AS ({chosen})
SELECT s.source_id AS {ident(id_column)},
       s.* EXCLUDE (run_id, source_id),
       u.chunk_index, u.n_chunks,
       CASE WHEN r.outcome IN {_ANSWERED} THEN 'succeeded' ELSE 'failed' END AS status,
       r.outcome,
       {outputs},
       CASE WHEN u.custom_id = '' THEN 'empty_text: the row''s text is empty'
            WHEN r.outcome IN {_ANSWERED} THEN NULL
            ELSE coalesce(r.outcome || ': ' || r.error, r.outcome, 'no answer') END
           AS failure_reason,
       u.run_id
FROM chosen
JOIN units u ON u.run_id = chosen.run_id AND u.kind = 'row'
JOIN {ident(src_table)} s ON s.run_id = u.run_id AND s.source_id = u.source_id
LEFT JOIN results r ON r.custom_id = u.custom_id
ORDER BY u.source_id, u.chunk_index
"""


def job_view_sql(
    job: str, view: str, src_table: str, id_column: str, schema: dict[str, Any]
) -> str:
    """The job's view in the published file: its latest published run."""
    return (
        f"CREATE OR REPLACE VIEW {ident(view)} AS {job_rows_sql(job, src_table, id_column, schema)}"
    )


ROW_COSTS_VIEW = f"""
CREATE OR REPLACE VIEW row_costs AS
WITH fan AS (
    SELECT run_id, custom_id, count(*) AS units FROM units WHERE custom_id <> '' GROUP BY 1, 2
)
SELECT u.run_id, u.source_id, u.unit_id, u.kind, u.cache_hit, fan.units AS units_sharing_request,
       CASE WHEN r.run_id = u.run_id THEN r.cost_usd / fan.units ELSE 0 END AS cost_usd,
       r.outcome IN {_ANSWERED} AS answered
FROM units u
JOIN fan ON fan.run_id = u.run_id AND fan.custom_id = u.custom_id
LEFT JOIN results r ON r.custom_id = u.custom_id
"""
"""Each unit's share of what its request cost in that run (0 for cache hits from earlier runs);
summed per run it equals the run's cost of the requests its units used."""


def source_table(view: str) -> str:
    return f"src_{view}"


class PublishingStore(RunsStore):
    def publish(self, db_path: str | Path) -> Path:
        """Write a fresh published file from the state file and swap it in atomically; every
        job in the state file gets its typed view (its latest published run)."""
        db_path = Path(db_path)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = db_path.with_name(f".{db_path.name}.{uuid.uuid4().hex[:8]}.tmp")
        with self._connect() as con:
            con.execute(f"ATTACH {literal(str(tmp))} AS pub")
            try:
                present = {
                    r[0]
                    for r in con.execute(
                        "SELECT table_name FROM duckdb_tables() "
                        "WHERE database_name = current_database()"
                    ).fetchall()
                }
                for table in sorted(present):
                    if table in PIPELINE_TABLES or table.startswith("src_"):
                        con.execute(
                            f"CREATE TABLE pub.{ident(table)} AS SELECT * FROM {ident(table)}"
                        )
            finally:
                con.execute("DETACH pub")
        jobs = self.job_views()
        pub = duckdb.connect(str(tmp))
        try:
            pub.execute(ROW_COSTS_VIEW)
            for job in jobs:
                src = source_table(job["view"])
                has_src = pub.execute(
                    "SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [src]
                ).fetchall()[0]
                if not has_src or not has_src[0]:
                    continue
                pub.execute(
                    job_view_sql(job["job"], job["view"], src, job["id_column"], job["schema"])
                )
            pub.execute("CHECKPOINT")
        finally:
            pub.close()
        os.replace(tmp, db_path)
        return db_path
