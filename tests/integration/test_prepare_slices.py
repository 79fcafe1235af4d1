"""load → chunk → dedupe → assemble stream the input a slice at a time: the run they prepare
must not depend on where the slices fall. The sample job (long texts cut in pieces, duplicates,
an eval set, urgent rows) is prepared twice into two state files, once in slices far smaller
than the data, and the two manifests compared row for row."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

import tasks.chunk
import tasks.dedupe
import tasks.load
from flows.enrich import open_run, prepare
from lowtide.context import run_context
from lowtide.jobspec import load_job
from lowtide.settings import Settings
from tests.integration.conftest import write_job
from tests.sql import query

pytestmark = pytest.mark.usefixtures("prefect_harness")

_UNITS = (
    "SELECT kind, unit_id, source_id, chunk_index, n_chunks, unit_tokens, "
    "CASE kind WHEN 'row' THEN custom_id END AS custom_id, cache_hit "
    "FROM units WHERE run_id = ? ORDER BY kind, unit_id"
)
# the eval set's keys carry the run id: rows are compared by key, eval requests by message
_REQUESTS = (
    "SELECT CASE WHEN u.kind = 'row' THEN r.custom_id END AS custom_id, r.est_input_tokens, "
    "CASE WHEN u.kind = 'row' THEN r.line ELSE u.unit_id END AS line, b.shard, "
    "b.backend = 'realtime' AS urgent "
    "FROM requests r JOIN batch_requests br USING (custom_id) JOIN batches b USING (batch_id) "
    "JOIN (SELECT DISTINCT ON (custom_id) custom_id, kind, unit_id FROM units "
    "      WHERE run_id = ? ORDER BY custom_id, unit_id) u USING (custom_id) "
    "ORDER BY ALL"
)


def _prepare(job_file: Path, state: Path, emulator_url: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    settings = Settings().with_overrides(state=str(state), db=str(state.with_suffix(".db")))
    with run_context(settings, load_job(str(job_file)), emulator_url) as ctx:
        run_id = open_run(ctx)
        prepare(ctx, run_id)
    return query(state, _UNITS, [run_id]), query(state, _REQUESTS, [run_id])


def test_slices_do_not_change_what_a_run_asks(
    emulator, clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(
        clean_env,
        rows=1200,
        replace={'text_column = "body"': 'text_column = "body"\npriority_column = "rush"'},
    )
    messages = pl.read_csv(clean_env / "messages.csv")

    def rush(every: int) -> pl.Expr:
        flag = pl.int_range(pl.len()) % every == 0
        return pl.when(flag).then(pl.lit("yes")).otherwise(pl.lit("")).alias("rush")

    # every message twice under two ids, in two halves of the input urgent on different rows:
    # a request is urgent when any of its rows is, however far apart the slices put them
    copies = messages.with_columns(("dup-" + pl.col("message_id")).alias("message_id"))
    both = pl.concat([messages.with_columns(rush(7)), copies.with_columns(rush(3))])
    both.write_csv(clean_env / "messages.csv")

    whole_units, whole_requests = _prepare(job, clean_env / "whole.duckdb", emulator.base_url)
    monkeypatch.setattr(tasks.load, "SOURCES_ROW_GROUP", 97)
    monkeypatch.setattr(tasks.chunk, "_FILE_SLICE_ROWS", 211)
    monkeypatch.setattr(tasks.dedupe, "_SLICE_ROWS", 173)
    sliced_units, sliced_requests = _prepare(job, clean_env / "sliced.duckdb", emulator.base_url)

    assert whole_units.height > both.height  # long texts were cut in pieces
    assert whole_units["n_chunks"].max() > 1
    assert (whole_units["kind"] == "eval").sum() == 40
    assert whole_units.equals(sliced_units)
    # duplicates were asked once, and urgency survived the fan-out
    n_row_requests = whole_units.filter(pl.col("kind") == "row")["custom_id"].n_unique()
    assert whole_requests.filter(pl.col("custom_id").is_not_null()).height == n_row_requests
    assert n_row_requests < whole_units.filter(pl.col("kind") == "row").height
    urgent = whole_requests.filter(pl.col("custom_id").is_not_null())["urgent"]
    assert 0 < urgent.sum() < urgent.len()
    assert whole_requests.equals(sliced_requests)


def test_a_first_night_writes_each_message_once_however_the_slices_fall(
    emulator, clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(clean_env, rows=300, eval_rows=5)
    messages = pl.read_csv(clean_env / "messages.csv")
    copies = messages.with_columns(("dup-" + pl.col("message_id")).alias("message_id"))
    pl.concat([messages, copies]).write_csv(clean_env / "messages.csv")  # each text twice
    monkeypatch.setattr(tasks.dedupe, "_SLICE_ROWS", 173)  # the copies fall in later slices
    state = clean_env / "state.duckdb"
    settings = Settings().with_overrides(state=str(state), db=str(clean_env / "lowtide.duckdb"))
    with run_context(settings, load_job(str(job)), emulator.base_url) as ctx:
        run_id = open_run(ctx)
        prepare(ctx, run_id)
        to_send = pl.read_parquet(ctx.work_dir(run_id) / "to_send.parquet")
    # the messages file was kept as it is (renamed, so it still numbers its rows), not copied
    assert "_row" in to_send.columns
    assert to_send["custom_id"].is_unique().all()
    asked = query(state, "SELECT count(DISTINCT custom_id) AS n FROM requests")["n"][0]
    assert to_send.height == asked
