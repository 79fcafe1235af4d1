"""An incremental job (`[input] cursor_column`): each night reads only the rows past the mark of
the last completed run, and the job view keeps every row ever enriched, a re-read row's new
answer replacing its old one. Real Prefect, the emulator over HTTP, real DuckDB files."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import polars as pl
import pytest

from flows.enrich import enrich
from lowtide.emulator import Emulator
from lowtide.errors import InputError
from lowtide.jobspec import load_job
from lowtide.settings import Settings
from lowtide.store import Store
from tasks.estimate import estimate_job
from tasks.load import Cursor, read_table, scan_input
from tests.conftest import SAMPLE_JOB
from tests.integration.conftest import write_job

CURSOR = {
    'text_column = "body"\n': 'text_column = "body"\ncursor_column = "seq"\n',
    '"received_at"]': '"received_at", "seq"]',  # shown in the view
    "[qa]\n": "[qa]\neval_every_run = false\n",  # so a night's requests are its rows' alone
}
VIEW = "SELECT message_id, seq, body, summary, run_id FROM support_intents ORDER BY seq"


def _messages(n: int) -> pl.DataFrame:
    """`n` short sample messages with distinct texts and an increasing `seq`."""
    frame = pl.read_csv(SAMPLE_JOB.parent.parent / "support" / "messages.csv", infer_schema=False)
    frame = frame.filter(pl.col("body").str.len_chars() < 400).unique("body", keep="first")
    frame = frame.sort("message_id").head(n)
    return frame.with_columns(pl.int_range(1, n + 1).alias("seq")).select(
        "message_id", "seq", "channel", "customer_tier", "received_at", "body"
    )


def _job(tmp_path: Path, rows: pl.DataFrame) -> Path:
    job = write_job(tmp_path, rows=1, eval_rows=5, replace=CURSOR)
    rows.write_csv(tmp_path / "messages.csv")
    return job


def _view(tmp_path: Path) -> list[dict]:
    with duckdb.connect(str(tmp_path / "lowtide.duckdb"), read_only=True) as con:
        return pl.from_arrow(con.sql(VIEW).to_arrow_table()).to_dicts()  # type: ignore[union-attr]


def _asked(emulator: Emulator) -> int:
    return sum(emulator.ledger.count_by_custom_id().values())


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_each_night_reads_only_new_or_changed_rows_and_the_view_keeps_them_all(
    emulator: Emulator, tmp_path: Path
) -> None:
    everything = _messages(16)
    job = _job(tmp_path, everything.head(10))
    first = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert first["status"] == "completed" and first["rows"] == 10
    assert first["cursor_from"] is None and first["cursor_high"] == '{"type":"integer","value":10}'
    before = {r["message_id"]: r for r in _view(tmp_path)}
    assert len(before) == 10

    # night 2: six rows appended past the mark; only they are read and asked (and quoted)
    everything.write_csv(tmp_path / "messages.csv")
    quote = estimate_job(load_job(job), Settings())
    assert quote["rows"] == 6
    asked = _asked(emulator)
    second = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert second["status"] == "completed" and second["rows"] == 6
    assert second["requests_sent"] == 6 and _asked(emulator) == asked + 6
    view = _view(tmp_path)
    assert [r["seq"] for r in view] == list(range(1, 17))
    assert {r["run_id"] for r in view if r["seq"] <= 10} == {first["run_id"]}
    assert {r["run_id"] for r in view if r["seq"] > 10} == {second["run_id"]}
    assert all(r["summary"] for r in view)

    # night 3: one old row's text changes and its cursor moves; it alone is read, and its new
    # answer replaces the old one while every other row keeps its own
    new_text = "My parcel never arrived, the tracking page is blank and nobody answers the phone."
    changed = everything.with_columns(
        pl.when(pl.col("seq") == 3).then(pl.lit(new_text)).otherwise("body").alias("body"),
        pl.when(pl.col("seq") == 3).then(17).otherwise("seq").alias("seq"),
    )
    changed.write_csv(tmp_path / "messages.csv")
    asked = _asked(emulator)
    third = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert third["status"] == "completed" and third["rows"] == 1
    assert third["requests_sent"] == 1 and _asked(emulator) == asked + 1
    view = {r["message_id"]: r for r in _view(tmp_path)}
    assert len(view) == 16
    moved = everything.filter(pl.col("seq") == 3)["message_id"][0]
    assert view[moved]["body"] == new_text and view[moved]["seq"] == 17
    assert view[moved]["run_id"] == third["run_id"]
    assert view[moved]["summary"] != before[moved]["summary"]
    for message_id, row in before.items():
        if message_id != moved:
            assert (view[message_id]["summary"], view[message_id]["run_id"]) == (
                row["summary"],
                first["run_id"],
            )

    # night 4: a text edited without moving its cursor is not read; nothing new is no error,
    # the run completes with no rows and the view is as it was
    changed.with_columns(
        pl.when(pl.col("seq") == 5).then(pl.lit("edited quietly")).otherwise("body").alias("body")
    ).write_csv(tmp_path / "messages.csv")
    shown = _view(tmp_path)
    fourth = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert fourth["status"] == "completed" and fourth["rows"] == 0
    assert fourth["requests_sent"] == 0
    assert fourth["cursor_from"] == fourth["cursor_high"] == third["cursor_high"]
    assert _view(tmp_path) == shown


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_a_failed_night_does_not_move_the_mark(emulator: Emulator, tmp_path: Path) -> None:
    everything = _messages(12)
    job = _job(tmp_path, everything.head(8))
    first = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert first["rows"] == 8

    # two rows appended, one of them without a cursor value: the night fails at load
    broken = everything.head(10).with_columns(
        pl.when(pl.col("seq") == 10).then(None).otherwise("seq").alias("seq")
    )
    broken.write_csv(tmp_path / "messages.csv")
    with pytest.raises(InputError, match=r"\[input\] cursor_column 'seq' is empty in 1 row"):
        enrich(job_file=str(job), emulator_url=emulator.base_url)
    failed = Store(os.environ["LOWTIDE_STATE"]).list_runs().row(0, named=True)
    assert failed["status"] == "failed"

    # fixed: the next night reads every row past the first night's mark, the failed night's too
    everything.write_csv(tmp_path / "messages.csv")
    third = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert third["status"] == "completed" and third["rows"] == 4
    assert third["cursor_from"] == first["cursor_high"]
    assert [r["seq"] for r in _view(tmp_path)] == list(range(1, 13))


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_an_unknown_cursor_column_is_one_line_naming_the_key(
    emulator: Emulator, tmp_path: Path
) -> None:
    job = _job(tmp_path, _messages(4))
    job.write_text(job.read_text().replace('cursor_column = "seq"', 'cursor_column = "sequence"'))
    with pytest.raises(InputError) as raised:
        enrich(job_file=str(job), emulator_url=emulator.base_url)
    message = str(raised.value)
    assert "[input] cursor_column 'sequence' is not a column" in message
    assert "\n" not in message
    assert emulator.ledger.executions() == []


def test_the_cursor_filter_is_pushed_into_every_kind_of_source(tmp_path: Path) -> None:
    frame = pl.DataFrame(
        {"id": ["a", "b", "c"], "body": ["x", "y", "z"], "seq": [1, 2, 3], "on": [True] * 3}
    )
    frame.write_csv(tmp_path / "in.csv")
    frame.write_parquet(tmp_path / "in.parquet")
    frame.write_ndjson(tmp_path / "in.ndjson")
    with duckdb.connect(str(tmp_path / "in.duckdb")) as con:
        con.register("f", frame)
        con.execute("CREATE TABLE messages AS SELECT * FROM f")
    sources = [(str(tmp_path / f"in.{s}"), None) for s in ("csv", "parquet", "ndjson")]
    for path, database in [*sources, ("duckdb:messages", str(tmp_path / "in.duckdb"))]:
        read = read_table(path, database, ("id", "body"), Cursor("seq", 1))
        assert read["id"].to_list() == ["b", "c"], path
        assert read_table(path, database, ("id", "body"), Cursor("seq")).height == 3
        with pytest.raises(InputError, match=r"cursor_column 'on' is Boolean, which has no order"):
            read_table(path, database, ("id", "body"), Cursor("on"))
        with pytest.raises(InputError, match=r"\[input\] cursor_column 'nope' is not a column"):
            read_table(path, database, ("id", "body"), Cursor("nope", 1))


def test_the_id_column_can_be_the_cursor(tmp_path: Path) -> None:
    """An append-only table whose ids grow: the id column is its own cursor."""
    job = _job(tmp_path, _messages(5))
    rows = _messages(5).with_columns(pl.col("seq").alias("message_id"))
    rows.write_parquet(tmp_path / "messages.parquet")  # integer ids (a CSV's ids stay text)
    text = job.read_text().replace('cursor_column = "seq"', 'cursor_column = "message_id"')
    job.write_text(text.replace("messages.csv", "messages.parquet"))
    rows, height, high = scan_input(load_job(str(job)), 3)
    assert height == 2 and high == 5
    assert rows.collect()["source_id"].to_list() == ["4", "5"]
