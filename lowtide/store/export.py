"""Export one run's rows, as the job view shows them, for downstream tools."""

from __future__ import annotations

from pathlib import Path

from lowtide.settings import Settings
from lowtide.store.publish import job_rows_sql, source_table
from lowtide.store.state import Store, frame, sql_string

_COPY_FORMAT = {
    "parquet": "(FORMAT parquet)",
    "csv": "(FORMAT csv, HEADER)",
    "jsonl": "(FORMAT json)",
}


def export_run(settings: Settings, run_id: str, target: Path, fmt: str) -> int:
    """Write the run's rows to `target` in `fmt`; returns the row count."""
    store = Store(settings.state, settings.lock_timeout_s)
    run = store.get_run(run_id)
    if run is None:
        raise LookupError(f"no run {run_id!r} in {settings.state}")
    view = next((v for v in store.job_views() if v["job"] == run["job"]), None)
    if view is None:
        raise LookupError(f"job {run['job']!r} of run {run_id} is not in {settings.state}")
    sql = job_rows_sql(
        view["job"], source_table(view["view"]), view["id_column"], view["schema"], run_id=run_id
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    with store.connect() as con:
        con.execute(f"COPY ({sql}) TO {sql_string(str(target))} {_COPY_FORMAT[fmt]}")
        return int(frame(con, f"SELECT count(*) AS n FROM ({sql})")["n"][0])
