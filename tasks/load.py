"""load: input file or DuckDB table → frame of (source_id, text, extra columns)."""

from __future__ import annotations

import time
from pathlib import Path

import polars as pl
from prefect import task

from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.errors import InputError
from lowtide.jobspec import JobSpec
from lowtide.runlog import stage_log
from lowtide.store.compute import read_duckdb_table
from lowtide.store.publish import source_table

EVAL_FILE = "eval.parquet"
"""The eval set as loaded, in the run's work dir; qa reads it back instead of the source file."""

PRIORITY = "_priority"
"""Column carrying a row's urgency through chunking and dedupe (from [input] priority_column)."""


def read_table(
    path: str, database: str | None = None, text_columns: tuple[str, ...] = ()
) -> pl.DataFrame:
    """Read csv, parquet, jsonl/ndjson, or `duckdb:TABLE` from `database`. A CSV's ISO dates
    and timestamps become DATE/TIMESTAMP columns; `text_columns` (ids, text) stay text as
    written, so an id `007` is never read as the number 7."""
    if path.startswith("duckdb:"):
        table = path.removeprefix("duckdb:")
        if not database:
            raise InputError(f"{path}: set [input] database to the DuckDB file holding {table}")
        return read_duckdb_table(database, table, path)
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{path}: input file not found")
    suffix = p.suffix.lower()
    try:
        if suffix == ".csv":
            header = pl.read_csv(p, n_rows=0).columns
            return pl.read_csv(
                p,
                infer_schema_length=10_000,
                try_parse_dates=True,
                schema_overrides={c: pl.String for c in text_columns if c in header},
            )
        if suffix == ".parquet":
            return pl.read_parquet(p)
        if suffix in (".jsonl", ".ndjson"):
            return pl.read_ndjson(p, infer_schema_length=10_000)
    except (pl.exceptions.ComputeError, pl.exceptions.PolarsError, OSError) as e:
        raise InputError(f"{path}: cannot read as {suffix[1:]}: {e}") from e
    raise InputError(
        f"{path}: unsupported input type {suffix!r}; use csv, parquet, jsonl or duckdb:TABLE"
    )


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


def cast_columns(frame: pl.DataFrame, types: dict[str, str], where: str) -> pl.DataFrame:
    """Give columns the types `[input] columns` names; a value that does not convert is an
    error naming its column, row and value (never a silent NULL)."""
    for name, kind in types.items():
        if name not in frame.columns:
            continue
        cast = frame.select(_cast(pl.col(name), frame.schema[name], kind).alias("v"))["v"]
        lost = frame[name].is_not_null() & cast.is_null()
        if frame[name].dtype == pl.String:
            lost = lost & (frame[name].str.strip_chars() != "")
        if lost.any():
            row = int(lost.arg_true()[0])
            raise InputError(
                f"{where}: column {name!r} at data row {row + 2} holds "
                f"{frame[name][row]!r}, which does not convert to {kind}; fix the value or the column's "
                "type in [input] columns"
            )
        frame = frame.with_columns(cast.alias(name))
    return frame


def normalise_input(
    frame: pl.DataFrame,
    *,
    where: str,
    id_column: str,
    text_column: str,
    columns: list[str],
    column_types: dict[str, str] | None = None,
) -> pl.DataFrame:
    """Check the columns and ids, and return (source_id, text, *columns) with string ids."""
    missing = [c for c in [id_column, text_column, *columns] if c not in frame.columns]
    if missing:
        raise InputError(
            f"{where}: missing column(s) {missing}; the file has {frame.columns}. "
            "Fix the column names in the job file's [input] section."
        )
    out = frame.select(
        pl.col(id_column).cast(pl.String).alias("source_id"),
        pl.col(text_column).cast(pl.String).alias("text"),
        *[pl.col(c) for c in columns if c not in (id_column, text_column)],
    )
    out = cast_columns(out, column_types or {}, where)
    null_ids = out.with_row_index("row").filter(pl.col("source_id").is_null())
    if null_ids.height:
        rows = (null_ids["row"] + 2).head(5).to_list()  # +2: 1-based, after a header line
        raise InputError(
            f"{where}: {null_ids.height} row(s) have no {id_column!r} (first at data row(s) {rows}); "
            "every row needs an id"
        )
    dup = out.group_by("source_id").len().filter(pl.col("len") > 1)
    if dup.height:
        examples = dup["source_id"].head(5).to_list()
        raise InputError(
            f"{where}: {dup.height} duplicate value(s) in id column {id_column!r}, e.g. {examples}; "
            "ids must be unique"
        )
    return out


def load_input(job: JobSpec) -> pl.DataFrame:
    spec = job.input
    path = job.resolve(spec.path) or ""
    frame = read_table(path, job.resolve(spec.database), (spec.id_column, spec.text_column))
    rows = normalise_input(
        frame,
        where=path,
        id_column=spec.id_column,
        text_column=spec.text_column,
        columns=spec.column_names,
        column_types=spec.column_types,
    )
    if rows.is_empty():
        raise InputError(f"{path}: the input has no rows (only a header?); nothing to enrich")
    if spec.priority_column is None:
        return rows
    if spec.priority_column not in frame.columns:
        raise InputError(
            f"{path}: [input] priority_column {spec.priority_column!r} is not a column of the file"
        )
    flag = frame[spec.priority_column]
    if flag.dtype != pl.Boolean:  # accept 1/0, yes/no, true/false, urgent/''
        flag = flag.cast(pl.String).str.to_lowercase().is_in(["1", "true", "yes", "y", "urgent"])
    return rows.with_columns(flag.fill_null(False).alias(PRIORITY))


def load_eval_set(job: JobSpec) -> pl.DataFrame | None:
    """The gold set: (source_id, text, template columns, gold fields); None if the job has none."""
    if not job.qa.eval_set:
        return None
    path = job.resolve(job.qa.eval_set) or ""
    frame = read_table(path, text_columns=(job.qa.eval_id_column, job.input.text_column))
    template_cols = [c for c in job.prompt.template_fields() if c != "text"]
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


@task(name="load", task_run_name="load-{run_id}")
def load_task(ctx: RunContext, run_id: str) -> dict:
    """Read the input and the eval set; keep the input rows in the store (for the job view) and
    both as parquet files under the run's work dir for the next stages."""
    started = time.perf_counter()
    job = ctx.job
    rows = load_input(job)
    work_dir = ctx.work_dir(run_id)
    rows.write_parquet(work_dir / "sources.parquet")
    ctx.store.save_sources(
        source_table(job.view_name),
        run_id,
        # _priority steers sending only; analysts never see it
        rows.drop(PRIORITY, strict=False).rename({"text": job.input.text_column}),
    )
    crash_point("during_load")
    out: dict = {"sources": str(work_dir / "sources.parquet"), "rows": rows.height, "eval": None}
    evals = load_eval_set(job)
    if evals is not None:
        evals.write_parquet(work_dir / EVAL_FILE)
        out["eval"] = str(work_dir / EVAL_FILE)
        out["eval_rows"] = evals.height
    stage_log(
        "load",
        "%d rows and %s eval rows from %s in %.1f s",
        rows.height,
        out.get("eval_rows", 0),
        job.input.path,
        time.perf_counter() - started,
    )
    return out
