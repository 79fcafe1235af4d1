"""The published file: what analysts open.

It is rebuilt from the state file into a new file and renamed over the old one, so a reader sees
the previous or the next state, never half of one, and a reader holding the old file open blocks
nothing (it keeps reading the old inode).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import duckdb

from lowtide.errors import PublishError, StateMemoryError
from lowtide.interrupts import kept_through_duckdb
from lowtide.output_fields import default_reduce, json_type
from lowtide.store._sql import ident, json_path, literal, literal_list
from lowtide.store.publish_delta import FREE_AT_MOST, refresh_tables
from lowtide.store.runs import RunsStore
from lowtide.store.shown_runs import shown_run_sql, views_runs
from lowtide.store.sources import MEMBERS, content_table, source_table, source_view_sql
from lowtide.store.state_copy import copy_at_checkpoint
from lowtide.uncached_files import copy_uncached
from lowtide.vocabulary import ANSWERED

PIPELINE_TABLES = (
    "schema_version",
    "jobs",
    "request_templates",
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
    MEMBERS,
)

ADDED_TO_ONLY: dict[str, tuple[str, ...]] = {
    # custom_id is derived from the request's content; the run that first asked it tells a
    # state file made anew (asking the same requests in other runs) from the one published;
    # `message_file` may be pointed at a new file (its old one lost): nothing published reads it
    "requests": ("custom_id", "first_run_id"),
    "batch_requests": (),
    MEMBERS: (),
    "units": (),  # a run prepared again (resumed) replaces its units under the same keys
}
"""The pipeline tables whose rows are only ever inserted or deleted, never changed in place,
each with the columns that tell its rows apart (none named: all of them): a publish compares
these tables by those columns instead of hashing whole rows (`publish_delta`). A job's stored
input rows (`content_table`) are compared by (source_id, lowtide_row_key): the row key is a
hash of the other columns."""

log = logging.getLogger(__name__)

_ANSWERED = literal_list(ANSWERED)
_SQL_TYPES = {"string": "VARCHAR", "integer": "BIGINT", "number": "DOUBLE", "boolean": "BOOLEAN"}


def _field_type(spec: dict[str, Any]) -> str:
    """The view column's type: an ENUM for a string field with `enum`, a list for an array of
    scalars, JSON for what has no column type."""
    kind = json_type(spec)
    values = [v for v in spec.get("enum", []) if v is not None]
    if kind == "string" and values and all(isinstance(v, str) for v in values):
        return f"ENUM({', '.join(literal(v) for v in dict.fromkeys(values))})"
    if kind == "array":
        items = spec.get("items")
        item = _SQL_TYPES.get(json_type(items)) if isinstance(items, dict) else None
        return f"{item or 'JSON'}[]"
    return _SQL_TYPES.get(kind, "JSON")


def _field_expr(name: str, spec: dict[str, Any]) -> str:
    sql_type = _field_type(spec)
    path = json_path(name)
    if sql_type == "JSON":
        return f"json_extract(r.output, {path})"
    if sql_type.endswith("[]"):
        return f"TRY_CAST(json_extract(r.output, {path}) AS {sql_type})"
    return f"TRY_CAST(json_extract_string(r.output, {path}) AS {sql_type})"


def _chosen(job: str, run_id: str | None) -> str:
    if run_id is not None:
        return (
            f"SELECT coalesce(max(unchanged_from), {literal(run_id)}) AS run_id FROM runs "
            f"WHERE run_id = {literal(run_id)}"
        )
    return shown_run_sql(job)


def _merged(runs: list[str]) -> str:
    values = ", ".join(f"({literal(r)}, {i})" for i, r in enumerate(runs))
    return f"SELECT * FROM (VALUES {values}) AS m(run_id, rank)"


def _properties(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: (v if isinstance(v, dict) else {}) for k, v in schema.get("properties", {}).items()}


def _unit_rows(
    job: str, schema: dict[str, Any], run_id: str | None, merged: list[str] | None = None
) -> str:
    """One row per unit of the chosen run: its chunk, its outcome, its typed answer. With
    `merged` (runs oldest first), each row's units come from the newest of them holding it."""
    outputs = "".join(
        f",\n           {_field_expr(name, spec)} AS {ident(name)}"
        for name, spec in _properties(schema).items()
    )
    chosen = _merged(merged) if merged else _chosen(job, run_id)
    newest = (
        "QUALIFY chosen.rank = max(chosen.rank) OVER (PARTITION BY u.source_id)" if merged else ""
    )
    return f"""
    WITH chosen AS ({chosen})
    SELECT u.source_id, u.chunk_index, u.n_chunks, u.run_id, r.outcome,
           coalesce(r.outcome IN {_ANSWERED}, false) AND u.custom_id <> '' AS answered,
           CASE WHEN u.custom_id = '' THEN 'empty_text: the row''s text is empty or only whitespace'
                WHEN r.outcome IN {_ANSWERED} THEN NULL
                ELSE coalesce(r.outcome || ': ' || r.error, r.outcome, 'no answer') END
               AS failure_reason,
           CASE WHEN r.outcome IN {_ANSWERED} THEN ar.backend END AS answered_by{outputs}
    FROM chosen
    JOIN units u ON u.run_id = chosen.run_id AND u.kind = 'row'
    LEFT JOIN results r ON r.custom_id = u.custom_id
    LEFT JOIN runs ar ON ar.run_id = r.run_id  -- the backend whose run asked (a route's step)
    {newest}
    """


def chunk_rows_sql(
    job: str,
    src_table: str,
    id_column: str,
    schema: dict[str, Any],
    run_id: str | None = None,
    merged: list[str] | None = None,
) -> str:
    """One row per chunk of the run (default: the job's shown run; with `merged`, each row from
    the newest of those runs holding it): the chunk's own answer."""
    fields = "".join(f", c.{ident(name)}" for name in _properties(schema))
    return f"""
WITH c AS ({_unit_rows(job, schema, run_id, merged)})
SELECT c.source_id AS {ident(id_column)}, s.* EXCLUDE (run_id, source_id),
       c.chunk_index, c.n_chunks,
       CASE WHEN c.answered THEN 'succeeded' ELSE 'failed' END AS status,
       c.outcome{fields}, c.failure_reason, c.answered_by, c.run_id
FROM c JOIN {ident(src_table)} s ON s.run_id = c.run_id AND s.source_id = c.source_id
ORDER BY c.source_id, c.chunk_index
"""


_ANSWERED_ONLY = "FILTER (WHERE answered AND {f} IS NOT NULL)"
_REDUCERS = {
    "first": "arg_min({f}, chunk_index) " + _ANSWERED_ONLY,
    "any": "bool_or({f}) " + _ANSWERED_ONLY,
    "all": "bool_and({f}) " + _ANSWERED_ONLY,
    "max": "max({f}) " + _ANSWERED_ONLY,
    "min": "min({f}) " + _ANSWERED_ONLY,
    "mean": "avg({f}) " + _ANSWERED_ONLY,
    "concat": "string_agg({f}, ' ' ORDER BY chunk_index) " + _ANSWERED_ONLY,
    "union": "list_sort(list_distinct(flatten(list({f} ORDER BY chunk_index) "
    + _ANSWERED_ONLY
    + ")))",
}


def job_rows_sql(
    job: str,
    src_table: str,
    id_column: str,
    schema: dict[str, Any],
    run_id: str | None = None,
    reduce: dict[str, str] | None = None,
    merged: list[str] | None = None,
) -> str:
    """One row per input row of the run (default: the job's shown run; with `merged`, each row
    from the newest of those runs holding it): source columns, each output field reduced over
    the row's answered chunks by its rule (`[output] reduce`), the row's status (succeeded only
    when every chunk was answered), its first failure and how many of its chunks were
    answered."""
    rules = {name: default_reduce(spec) for name, spec in _properties(schema).items()}
    rules.update(reduce or {})
    aggregates, joins, picks = [], [], []
    for i, name in enumerate(rules):
        f = ident(name)
        if rules[name] == "majority":
            # the value most chunks gave; a tie goes to the value an earlier chunk gave
            joins.append(
                f"LEFT JOIN (SELECT source_id, arg_max(v, n * 1000000 - first) AS v FROM "
                f"(SELECT source_id, {f} AS v, count(*) AS n, min(chunk_index) AS first "
                f"FROM c WHERE answered AND {f} IS NOT NULL GROUP BY 1, 2) GROUP BY 1) m{i} "
                f"ON m{i}.source_id = g.source_id"
            )
            picks.append(f"m{i}.v AS {f}")
        else:
            aggregates.append(f"{_REDUCERS[rules[name]].format(f=f)} AS {f}")
            picks.append(f"g.{f}")
    agg_sql = "".join(f",\n           {a}" for a in aggregates)
    pick_sql = "".join(f", {p}" for p in picks)
    return f"""
WITH c AS ({_unit_rows(job, schema, run_id, merged)}),
g AS (
    SELECT source_id, any_value(run_id) AS run_id, max(n_chunks) AS n_chunks,
           count(*) FILTER (WHERE answered) AS chunks_answered,
           coalesce(arg_min(outcome, chunk_index) FILTER (WHERE NOT answered),
                    arg_min(outcome, chunk_index)) AS outcome,
           arg_min(failure_reason, chunk_index) FILTER (WHERE NOT answered) AS first_failure,
           min(chunk_index) FILTER (WHERE NOT answered) AS first_failed_chunk,
           string_agg(DISTINCT answered_by, ',' ORDER BY answered_by) AS answered_by{agg_sql}
    FROM c GROUP BY source_id
)
SELECT g.source_id AS {ident(id_column)}, s.* EXCLUDE (run_id, source_id),
       CASE WHEN g.chunks_answered = g.n_chunks THEN 'succeeded' ELSE 'failed' END AS status,
       g.outcome{pick_sql},
       CASE WHEN g.chunks_answered = g.n_chunks THEN NULL
            WHEN g.n_chunks = 1 THEN g.first_failure
            ELSE g.first_failure || ' (chunk ' || (g.first_failed_chunk + 1) || ' of '
                 || g.n_chunks || '; ' || g.chunks_answered || ' answered)' END
           AS failure_reason,
       g.chunks_answered, g.n_chunks, g.answered_by, g.run_id
FROM g JOIN {ident(src_table)} s ON s.run_id = g.run_id AND s.source_id = g.source_id
{chr(10).join(joins)}
ORDER BY g.source_id
"""


def job_view_sql(
    job: str,
    view: str,
    src_table: str,
    id_column: str,
    schema: dict[str, Any],
    reduce: dict[str, str] | None = None,
    run_id: str | None = None,
    merged: list[str] | None = None,
) -> str:
    """The job's views in the published file: one row per input row of its shown run (of an
    incremental job: of the `merged` runs, each row from the newest holding it), and
    `<view>_chunks` with one row per chunk."""
    rows = job_rows_sql(job, src_table, id_column, schema, run_id, reduce, merged)
    chunks = chunk_rows_sql(job, src_table, id_column, schema, run_id, merged)
    return (
        f"CREATE OR REPLACE VIEW {ident(view)} AS {rows};\n"
        f"CREATE OR REPLACE VIEW {ident(view + '_chunks')} AS {chunks}"
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


def _wal(path: Path) -> Path:
    """DuckDB's write-ahead log beside a database file."""
    return path.with_name(path.name + ".wal")


def _remove(tmp: Path) -> None:
    """A temporary file and its log, if any (suppressing errors: e.g. its folder is the fault)."""
    for leftover in (tmp, _wal(tmp)):
        with contextlib.suppress(OSError):
            leftover.unlink()


def _published(table: str) -> bool:
    """Whether a table of the state file goes into the published file."""
    return table in PIPELINE_TABLES or table.startswith("src_")


def _published_only(pub: duckdb.DuckDBPyConnection) -> None:
    """Drop every view, schema but `main`, and table `_published` leaves out, of a copy of the
    state file."""
    here = "database_name = current_database() AND NOT internal"
    for (schema,) in pub.execute(
        f"SELECT schema_name FROM duckdb_schemas() WHERE {here} AND schema_name <> 'main'"
    ).fetchall():
        pub.execute(f"DROP SCHEMA {ident(schema)} CASCADE")
    for (view,) in pub.execute(f"SELECT view_name FROM duckdb_views() WHERE {here}").fetchall():
        pub.execute(f"DROP VIEW {ident(view)}")
    for (table,) in pub.execute(
        f"SELECT table_name FROM duckdb_tables() WHERE {here} AND schema_name = 'main'"
    ).fetchall():
        if not _published(table):
            pub.execute(f"DROP TABLE {ident(table)}")


def _previous(db_path: Path, tmp: Path) -> bool:
    """Copy the previous published file to `tmp` to be patched; False (nothing copied) when
    there is none, or it has a write-ahead log beside it (someone wrote to it: start afresh)."""
    if not db_path.is_file() or _wal(db_path).exists():
        return False
    copy_uncached(db_path, tmp)
    return True


class PublishingStore(RunsStore):
    def publish(self, db_path: str | Path, showing: str | None = None) -> Path:
        """Write a new published file from the state file and swap it in atomically; every
        job in the state file gets its typed views of its shown run (`showing` counts as
        published: mark it so once this returns). The new file starts as a copy of the state
        file taken at a checkpoint (`state_copy`), without the tables only the state keeps;
        when no such copy can be taken, as a copy of the previous published file patched with
        what changed (`publish_delta`); else it is written whole. PublishError, naming the
        published file, when it cannot be written: the previous file is then left as it was."""
        db_path = Path(db_path)
        tmp = db_path.with_name(f".{db_path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            with kept_through_duckdb():  # the published file's own connection too
                self._write_published(db_path, tmp, showing)
            os.replace(tmp, db_path)
            # a log someone left beside the previous file belongs to it, not to this one (DuckDB
            # would refuse to open the new file with it)
            _wal(db_path).unlink(missing_ok=True)
        except (duckdb.Error, OSError, StateMemoryError) as e:  # the last says what to raise
            _remove(tmp)
            raise PublishError(
                f"{db_path}: cannot write the published file: {' '.join(str(e).split())}; "
                "the previous file is unchanged"
            ) from e
        except BaseException:  # interrupted: no half-written file left beside the published one
            _remove(tmp)
            raise
        return db_path

    def _write_published(self, db_path: Path, tmp: Path, showing: str | None) -> None:
        """`tmp` is a copy of the state file (trimmed to what is published), else a copy of
        the previous published file patched with what changed, else written table by table."""
        if self._snapshot(tmp) and self._finished(tmp, showing, "copied from the state file"):
            return
        if _previous(db_path, tmp) and self._finished(tmp, showing, "patched", patch=True):
            return
        self._write_tables(tmp, patch=False)
        self._write_views(tmp, showing)
        log.info("%s: written whole", tmp)

    def _finished(self, tmp: Path, showing: str | None, how: str, patch: bool = False) -> bool:
        """Finish `tmp`, a copy of the previous published file (`patch`: its tables are brought
        up to the state file's) or of the state file (trimmed to what is published), with the
        views. False, removing it, when that fails (the copy is damaged, not DuckDB) or leaves
        more than FREE_AT_MOST of it free space."""
        try:
            if patch:
                self._write_tables(tmp, patch=True)
            free = self._write_views(tmp, showing, trim=not patch)
            if free <= FREE_AT_MOST:
                log.info("%s: %s", tmp, how)
                return True
            why = f"{free:.0%} of it free space"
        except duckdb.Error as e:
            why = " ".join(str(e).split())
        log.info("%s: not %s (%s)", tmp, how, why)
        _remove(tmp)
        return False

    def _snapshot(self, tmp: Path) -> bool:
        """Copy the state file to `tmp` (`copy_at_checkpoint`); False, leaving nothing at
        `tmp`, when the copy might not be one state of it."""
        with self._connect() as con:
            copied = copy_at_checkpoint(con, self.path, tmp)
        if not copied:
            _remove(tmp)
        return copied

    def _write_tables(self, tmp: Path, patch: bool) -> None:
        """Every pipeline and sources table of the state file into `tmp`: patched where `tmp`
        is a copy of the previous file, else copied whole."""
        with self._connect() as con:
            con.execute(f"ATTACH {literal(str(tmp))} AS pub")
            try:
                tables = sorted(
                    r[0]
                    for r in con.execute(
                        "SELECT table_name FROM duckdb_tables() "
                        "WHERE database_name = current_database()"
                    ).fetchall()
                    if _published(r[0])
                )
                if patch:
                    added_to_only = dict(ADDED_TO_ONLY)
                    added_to_only.update(
                        (t, ("source_id", "lowtide_row_key"))
                        for t in tables
                        if t.startswith("src_") and t.endswith("-rows")
                    )
                    refresh_tables(con, tables, added_to_only)
                else:
                    for table in tables:
                        con.execute(
                            f"CREATE TABLE pub.{ident(table)} AS SELECT * FROM {ident(table)}"
                        )
            finally:
                con.execute("DETACH pub")

    def _write_views(self, tmp: Path, showing: str | None, trim: bool = False) -> float:
        """The views of every job in `tmp`, then a checkpoint; returns the share of the file
        that is free space. `trim`: `tmp` is a copy of the state file; drop what analysts are
        not given first (its views, the tables `_published` leaves out). Which runs each view
        shows is read from `tmp` itself: a run of another job that ends after the copy was taken
        is not in it, so a view naming that run would show its rows without their answers."""
        pub = duckdb.connect(str(tmp))
        try:
            jobs, shown, merged = views_runs(pub, showing)
            if trim:
                _published_only(pub)
            pub.execute(ROW_COSTS_VIEW)
            for job in jobs:
                has_src = pub.execute(
                    "SELECT count(*) FROM duckdb_tables() WHERE table_name = ?",
                    [content_table(job["view"])],
                ).fetchall()[0]
                if not has_src or not has_src[0]:
                    continue
                src = source_table(job["view"])
                pub.execute(source_view_sql(job["view"]))
                pub.execute(
                    job_view_sql(
                        job["job"],
                        job["view"],
                        src,
                        job["id_column"],
                        job["schema"],
                        job["reduce"],
                        shown[job["job"]],
                        merged[job["job"]] or None,
                    )
                )
            pub.execute("CHECKPOINT")
            free, total = pub.execute(
                "SELECT free_blocks, total_blocks FROM pragma_database_size()"
            ).fetchall()[0]
            return free / max(total, 1)
        finally:
            pub.close()
