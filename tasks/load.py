"""load: input file or DuckDB table → frame of (source_id, text, extra columns)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

import orjson
import polars as pl

from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.errors import InputError
from lowtide.jobspec import JobSpec
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.slices import WORK_FILE_COMPRESSION
from lowtide.store.compute import read_duckdb_table

EVAL_FILE = "eval.parquet"
"""The eval set as loaded, in the run's work dir; qa reads it back instead of the source file."""

PRIORITY = "_priority"
"""Column carrying a row's urgency through chunking and dedupe (from [input] priority_column)."""


@dataclass(frozen=True)
class Cursor:
    """Read only the rows whose `column` is greater than `after` (every row when None), and
    those with no value in it (so that they are refused, not skipped for ever)."""

    column: str
    after: Any = None


_CURSOR_KINDS = "an integer, number, date, timestamp or text column"


def cursor_kind(dtype: pl.DataType) -> str | None:
    """The mark type of a cursor column: integer, number, date, timestamp or string (compared
    as text); None for a type that has no useful order (booleans, lists, decimals, ...)."""
    if dtype.is_integer():
        return "integer"
    if dtype.is_float():
        return "number"
    if dtype == pl.Date:
        return "date"
    if isinstance(dtype, pl.Datetime):
        return "timestamp"
    return "string" if dtype == pl.String else None


def _value_kind(value: Any) -> str:
    if isinstance(value, datetime):
        return "timestamp"
    if isinstance(value, date):
        return "date"
    if isinstance(value, int) and not isinstance(value, bool):
        return "integer"
    return "number" if isinstance(value, float) else "string"


def mark_json(value: Any) -> str:
    """A cursor value as a stored mark: `{"type": ..., "value": ...}` (dates as ISO text)."""
    kind = _value_kind(value)
    plain = value.isoformat() if kind in ("date", "timestamp") else value
    return orjson.dumps({"type": kind, "value": plain if kind != "string" else str(value)}).decode()


def mark_value(mark: str) -> tuple[str, Any]:
    """A stored mark back as (type, Python value)."""
    parsed = orjson.loads(mark)
    kind, plain = parsed["type"], parsed["value"]
    if kind == "timestamp":
        return kind, datetime.fromisoformat(plain)
    if kind == "date":
        return kind, date.fromisoformat(plain)
    return kind, plain


def _check_cursor(schema: pl.Schema, cursor: Cursor, where: str) -> pl.Expr:
    """The scan's filter for `cursor`, once its column is known to exist with an orderable type
    that compares with the mark."""
    if cursor.column not in schema:
        raise InputError(
            f"{where}: [input] cursor_column {cursor.column!r} is not a column of the input; "
            f"it has {list(schema)}"
        )
    dtype = schema[cursor.column]
    kind = cursor_kind(dtype)
    if kind is None:
        raise InputError(
            f"{where}: [input] cursor_column {cursor.column!r} is {dtype}, which has no order to "
            f"read past; name {_CURSOR_KINDS} that grows with each new or changed row"
        )
    col = pl.col(cursor.column)
    if cursor.after is None:
        return pl.lit(True)
    numeric = {"integer", "number"}
    mark_kind = _value_kind(cursor.after)
    if {mark_kind, kind} <= numeric:
        return (col > pl.lit(cursor.after)) | col.is_null()
    if mark_kind != kind:
        raise InputError(
            f"{where}: [input] cursor_column {cursor.column!r} is now {dtype}, but the last "
            f"run's mark is the {mark_kind} {cursor.after!r}; restore the column's type"
        )
    return (col > pl.lit(cursor.after, dtype=dtype)) | col.is_null()


def _csv_options(p: Path, text_columns: tuple[str, ...]) -> dict[str, Any]:
    """How a CSV is read, eagerly or as a scan: ISO dates typed, ids and text kept as written."""
    header = pl.read_csv(p, n_rows=0).columns
    return {
        "infer_schema_length": 10_000,
        "try_parse_dates": True,
        "schema_overrides": {c: pl.String for c in text_columns if c in header},
    }


def _scan(p: Path, suffix: str, text_columns: tuple[str, ...]) -> pl.LazyFrame | None:
    if suffix == ".csv":
        return pl.scan_csv(p, **_csv_options(p, text_columns))
    if suffix == ".parquet":
        return pl.scan_parquet(p)
    if suffix in (".jsonl", ".ndjson"):
        return pl.scan_ndjson(p, infer_schema_length=10_000)
    return None


@contextmanager
def _reading(path: str, suffix: str) -> Iterator[None]:
    """A file polars cannot read (bad bytes, a broken line) becomes an error naming it."""
    try:
        yield
    except (pl.exceptions.PolarsError, OSError) as e:
        # polars' own hints below the first line name its options, which users cannot set
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{path}: cannot read as {suffix[1:] or 'a table'}: {said}") from e


def scan_table(
    path: str,
    database: str | None = None,
    text_columns: tuple[str, ...] = (),
    cursor: Cursor | None = None,
) -> pl.LazyFrame:
    """`read_table`'s rows as a lazy scan: nothing is read but the schema, so that a run can
    check narrow columns and stream the rest to a file. A DuckDB table is read whole."""
    if path.startswith("duckdb:"):
        table = path.removeprefix("duckdb:")
        if not database:
            raise InputError(f"{path}: set [input] database to the DuckDB file holding {table}")
        if cursor is None:
            return read_duckdb_table(database, table, path).lazy()
        frame = read_duckdb_table(database, table, path, cursor.column, cursor.after)
        _check_cursor(frame.schema, cursor, path)
        return frame.lazy()
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: input file not found")
    suffix = p.suffix.lower()
    with _reading(path, suffix):
        scan = _scan(p, suffix, text_columns)
        if scan is None:
            raise InputError(
                f"{path}: unsupported input type {suffix!r}; use csv, parquet, jsonl or duckdb:TABLE"
            )
        schema = scan.collect_schema()  # a file that is no table fails here, not mid-run
    return scan if cursor is None else scan.filter(_check_cursor(schema, cursor, path))


def collect(scan: pl.LazyFrame, path: str) -> pl.DataFrame:
    """Run a scan of the input `path`; a read error names the file."""
    with _reading(path, Path(path).suffix.lower()):
        return scan.collect()


def every_field(path: str) -> pl.QueryOptFlags:
    """How rows are read in full: a CSV's every field is parsed, even in columns the job does
    not use, so that a line with a field too many (an unquoted comma) is an error, never a text
    cut short with its fields shifted. (Checks of one column may skip the others.)"""
    return pl.QueryOptFlags(projection_pushdown=Path(path).suffix.lower() != ".csv")


def read_table(
    path: str,
    database: str | None = None,
    text_columns: tuple[str, ...] = (),
    cursor: Cursor | None = None,
) -> pl.DataFrame:
    """Read csv, parquet, jsonl/ndjson, or `duckdb:TABLE` from `database`. A CSV's ISO dates
    and timestamps become DATE/TIMESTAMP columns; `text_columns` (ids, text) stay text as
    written, so an id `007` is never read as the number 7. With a `cursor`, only the rows past
    its mark are read, the filter pushed into the scan (a DuckDB `WHERE`, a polars scan)."""
    return collect(scan_table(path, database, text_columns, cursor), path)


_POLARS_TYPES: dict[str, pl.DataType] = {
    "string": pl.String(),
    "integer": pl.Int64(),
    "number": pl.Float64(),
    "boolean": pl.Boolean(),
    "date": pl.Date(),
    "timestamp": pl.Datetime("us"),
}


def _cast(col: pl.Expr, source: pl.DataType, kind: str) -> pl.Expr:
    if source == pl.String and kind in ("date", "timestamp"):
        return col.str.to_datetime(strict=False).cast(_POLARS_TYPES[kind])
    if source == pl.String and kind == "boolean":
        lowered = col.str.to_lowercase().str.strip_chars()
        return (
            pl.when(lowered.is_in(["true", "1", "yes", "y"]))
            .then(True)
            .when(lowered.is_in(["false", "0", "no", "n"]))
            .then(False)
        )
    return col.cast(_POLARS_TYPES[kind], strict=False)


def cast_columns(scan: pl.LazyFrame, types: dict[str, str], where: str) -> pl.LazyFrame:
    """Give columns the types `[input] columns` names; a value that does not convert is an
    error naming its column, row and value (never a silent NULL). Each column is checked by a
    scan of that column alone."""
    schema = scan.collect_schema()
    casts = []
    for name, kind in types.items():
        if name not in schema:
            continue
        col = pl.col(name)
        cast = _cast(col, schema[name], kind)
        lost = col.is_not_null() & cast.is_null()
        if schema[name] == pl.String:
            lost = lost & (col.str.strip_chars() != "")
        found = collect(
            scan.select(lost.arg_true().first().alias("row"), col.filter(lost).first().alias("v")),
            where,
        )
        if found["row"][0] is not None:
            raise InputError(
                f"{where}: column {name!r} at data row {found['row'][0] + 2} holds "
                f"{found['v'][0]!r}, which does not convert to {kind}; fix the value or the "
                "column's type in [input] columns"
            )
        casts.append(cast.alias(name))
    return scan.with_columns(casts) if casts else scan


def normalised_scan(
    scan: pl.LazyFrame,
    *,
    where: str,
    id_column: str,
    text_column: str,
    columns: list[str],
    column_types: dict[str, str] | None = None,
    extra: tuple[pl.Expr, ...] = (),
) -> tuple[pl.LazyFrame, int]:
    """Check the columns and ids, and return the scan of (source_id, text, *columns, *extra)
    with string ids, and its row count. Only the id column (and each typed column) is read
    here: the texts stay in the file until the caller streams or collects them."""
    names = scan.collect_schema().names()
    missing = [c for c in [id_column, text_column, *columns] if c not in names]
    if missing:
        raise InputError(
            f"{where}: missing column(s) {missing}; the file has {names}. "
            "Fix the column names in the job file's [input] section."
        )
    out = scan.select(
        pl.col(id_column).cast(pl.String).alias("source_id"),
        pl.col(text_column).cast(pl.String).alias("text"),
        *[pl.col(c) for c in columns if c not in (id_column, text_column)],
        *extra,
    )
    out = cast_columns(out, column_types or {}, where)
    ids = collect(out.select("source_id"), where)["source_id"]
    if ids.null_count():
        rows = (ids.is_null().arg_true() + 2).head(5).to_list()  # +2: 1-based, after a header
        raise InputError(
            f"{where}: {ids.null_count()} row(s) have no {id_column!r} (first at data row(s) "
            f"{rows}); every row needs an id"
        )
    dup = ids.value_counts().filter(pl.col("count") > 1)
    if dup.height:
        examples = dup["source_id"].head(5).to_list()
        raise InputError(
            f"{where}: {dup.height} duplicate value(s) in id column {id_column!r}, e.g. {examples}; "
            "ids must be unique"
        )
    return out, ids.len()


def normalise_input(
    frame: pl.DataFrame,
    *,
    where: str,
    id_column: str,
    text_column: str,
    columns: list[str],
    column_types: dict[str, str] | None = None,
) -> pl.DataFrame:
    """`normalised_scan` of a frame in memory, collected."""
    out, _ = normalised_scan(
        frame.lazy(),
        where=where,
        id_column=id_column,
        text_column=text_column,
        columns=columns,
        column_types=column_types,
    )
    return collect(out, where)


def load_input(job: JobSpec, after: Any = None) -> pl.DataFrame:
    """The job's input rows as (source_id, text, *columns[, _priority]); with `[input]
    cursor_column`, only those past the mark `after` (every row when None)."""
    rows, _, _ = scan_input(job, after)
    path = job.resolve(job.input.path) or ""
    with _reading(path, Path(path).suffix.lower()):
        return rows.collect(optimizations=every_field(path))


@contextmanager
def _ragged_lines_first(scan: pl.LazyFrame, path: str) -> Iterator[None]:
    """A check of one column reads a CSV line with a field too many as if its fields were
    shifted (an id ' world', a score 'c'): when a check fails, a full read says first whether
    the file itself is broken, so the error names the real cause."""
    try:
        yield
    except InputError:
        if Path(path).suffix.lower() == ".csv":
            with _reading(path, ".csv"):
                scan.select(pl.len()).collect(optimizations=every_field(path))
        raise


def scan_input(job: JobSpec, after: Any = None) -> tuple[pl.LazyFrame, int, Any]:
    """`load_input`'s rows as a checked scan, their count, and the largest cursor value among
    them (`after` when none was read; None for a job without a cursor). Past a mark, no new
    row is not an error: the run then has no rows and the job view stays as it was."""
    spec = job.input
    path = job.resolve(spec.path) or ""
    cursor = Cursor(spec.cursor_column, after) if spec.cursor_column else None
    scan = scan_table(path, job.resolve(spec.database), (spec.id_column, spec.text_column), cursor)
    schema = scan.collect_schema()
    extra: tuple[pl.Expr, ...] = ()
    if spec.priority_column is not None:
        if spec.priority_column not in schema:
            raise InputError(
                f"{path}: [input] priority_column {spec.priority_column!r} is not a column of "
                "the file"
            )
        flag = pl.col(spec.priority_column)
        if schema[spec.priority_column] != pl.Boolean:  # accept 1/0, yes/no, true/false, urgent
            flag = (
                flag.cast(pl.String).str.to_lowercase().is_in(["1", "true", "yes", "y", "urgent"])
            )
        extra = (flag.fill_null(False).alias(PRIORITY),)
    with _ragged_lines_first(scan, path):
        rows, height = normalised_scan(
            scan,
            where=path,
            id_column=spec.id_column,
            text_column=spec.text_column,
            columns=spec.column_names,
            column_types=spec.column_types,
            extra=extra,
        )
        high = None
        if cursor is not None:
            # both under names of their own: the cursor may be the id column itself
            marks = collect(
                scan.select(
                    pl.col(spec.id_column).alias("id"), pl.col(cursor.column).alias("mark")
                ),
                path,
            )
            values = marks["mark"]
            if values.null_count():
                ids = marks.filter(values.is_null())["id"].head(5).to_list()
                raise InputError(
                    f"{path}: [input] cursor_column {cursor.column!r} is empty in "
                    f"{values.null_count()} row(s), e.g. ids {ids}; every row needs a cursor value"
                )
            high = values.max() if values.len() else after
    if height == 0 and (cursor is None or after is None):
        raise InputError(f"{path}: the input has no rows (only a header?); nothing to enrich")
    return rows, height, high


def load_eval_set(job: JobSpec) -> pl.DataFrame | None:
    """The gold set: (source_id, text, template columns, gold fields); None if the job has none."""
    if not job.qa.eval_set:
        return None
    path = job.resolve(job.qa.eval_set) or ""
    frame = read_table(path, text_columns=(job.qa.eval_id_column, job.input.text_column))
    template_cols = [c for c in job.prompt.template_fields() if c != "text"]
    if frame.height == 0:
        # its gate would have nothing to score, and a run would fail at the end, paid for
        raise InputError(
            f"{path}: the eval set has no rows (only a header?); add gold rows or remove "
            "[qa] eval_set"
        )
    gold = [f for f in job.output_schema.get("properties", {}) if f in frame.columns]
    if not gold:
        raise InputError(
            f"{path}: the eval set has none of the output fields "
            f"{list(job.output_schema.get('properties', {}))} as gold columns"
        )
    out = normalise_input(
        frame,
        where=path,
        id_column=job.qa.eval_id_column,
        text_column=job.input.text_column,
        columns=template_cols + [g for g in gold if g not in template_cols],
    )
    return out


def _read_past_mark(ctx: RunContext, run_id: str) -> tuple[pl.LazyFrame, int]:
    """The input rows this run reads (a checked scan) and their count. With `[input]
    cursor_column`: only those past the mark of the job's last completed run, and the run
    records the mark it leaves (which counts only once it is completed and published:
    `Store.cursor_mark`)."""
    job = ctx.job
    column = job.input.cursor_column
    if column is None:
        rows, height, _ = scan_input(job)
        return rows, height
    read_past = ctx.store.cursor_mark(
        job.name, column=column, backend=ctx.backend, job_fingerprint=job.prompt_fingerprint()
    )
    rows, height, high = scan_input(job, mark_value(read_past)[1] if read_past else None)
    ctx.store.record_cursor(
        run_id,
        column=column,
        read_past=read_past,
        high=mark_json(high) if height else read_past,
    )
    return rows, height


SOURCES_ROW_GROUP = 50_000
"""Rows per row group of the run's sources file: chunk reads it back a group at a time."""


@task(name="load", task_run_name="load-{run_id}")
def load_task(ctx: RunContext, run_id: str) -> dict:
    """Read the input and the eval set; keep the input rows in the store (for the job view) and
    both as parquet files under the run's work dir for the next stages. The input streams from
    its file to the run's: only its ids (and typed columns, one at a time) are held whole."""
    started = time.perf_counter()
    job = ctx.job
    rows, height = _read_past_mark(ctx, run_id)
    sources = ctx.work_dir(run_id) / "sources.parquet"
    where = job.resolve(job.input.path) or ""
    with _reading(where, Path(where).suffix.lower()):
        rows.sink_parquet(
            sources,
            compression=WORK_FILE_COMPRESSION,
            row_group_size=SOURCES_ROW_GROUP,
            optimizations=every_field(where),
        )
    # _priority steers sending only; analysts never see it
    ctx.store.save_sources(job.view_name, run_id, sources, text_column=job.input.text_column)
    crash_point("during_load")
    out: dict = {"sources": str(sources), "rows": height, "eval": None}
    evals = load_eval_set(job)
    if evals is not None:
        evals.write_parquet(ctx.work_dir(run_id) / EVAL_FILE)
        out["eval"] = str(ctx.work_dir(run_id) / EVAL_FILE)
        out["eval_rows"] = evals.height
    stage_log(
        "load",
        "%d rows and %s eval rows from %s in %.1f s",
        height,
        out.get("eval_rows", 0),
        job.input.path,
        time.perf_counter() - started,
    )
    return out
