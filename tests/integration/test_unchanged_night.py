"""The second night: the same job over unchanged input asks nothing and reads no row. It is
recorded as a completed run pointing at the run whose rows the view shows; a file rewritten with
the same bytes counts as unchanged, a changed row does not. Without a configured Prefect server
the CLI answers such a night without starting Prefect at all. Real Prefect, the emulator over
HTTP, real DuckDB files."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import orjson
import polars as pl
import pytest

from flows.enrich import enrich
from lowtide.emulator import Emulator, EmulatorConfig
from tests.integration.conftest import lowtide_cli, write_job

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

NO_EVAL_EACH_RUN = {"[qa]\n": "[qa]\neval_every_run = false\n"}


def _published(tmp_path: Path, sql: str) -> list[tuple]:
    with duckdb.connect(str(tmp_path / "lowtide.duckdb"), read_only=True) as con:
        return con.execute(sql).fetchall()


def test_an_unchanged_night_asks_nothing_and_a_changed_row_is_asked_alone(
    emulator: Emulator, tmp_path: Path
) -> None:
    job = write_job(tmp_path, rows=40, eval_rows=5, replace=NO_EVAL_EACH_RUN)
    first = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert first["status"] == "completed" and first["requests_sent"] > 0
    asked = sum(emulator.ledger.count_by_custom_id().values())
    view = _published(
        tmp_path, "SELECT message_id, intent, status FROM support_intents ORDER BY message_id"
    )
    assert len(view) == 40

    second = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert second["status"] == "completed" and second["run_id"] != first["run_id"]
    assert second["unchanged_from"] == first["run_id"]
    assert second["requests_sent"] == 0 and second["cost_usd"] == 0
    assert (second["rows"], second["succeeded"]) == (first["rows"], first["succeeded"])
    assert sum(emulator.ledger.count_by_custom_id().values()) == asked
    # the view shows the same rows, and the published file lists the new run
    assert _published(
        tmp_path, "SELECT message_id, intent, status FROM support_intents ORDER BY message_id"
    ) == (view)
    shown = _published(tmp_path, "SELECT DISTINCT run_id FROM support_intents")
    assert shown == [(first["run_id"],)]
    assert _published(
        tmp_path, f"SELECT unchanged_from FROM runs WHERE run_id = '{second['run_id']}'"
    ) == [(first["run_id"],)]

    # the same bytes written again (a new modification time) are still unchanged
    messages = tmp_path / "messages.csv"
    messages.write_bytes(messages.read_bytes())
    os.utime(messages, ns=(1, 1))
    third = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert third["unchanged_from"] == first["run_id"] and third["requests_sent"] == 0

    # one changed row: a real run that asks only that row (every other answer is cached)
    frame = pl.read_csv(messages, infer_schema=False)
    frame = frame.with_columns(
        pl.when(pl.int_range(pl.len()) == 3)
        .then(pl.lit("My parcel never arrived and nobody answers the phone."))
        .otherwise(pl.col("body"))
        .alias("body")
    )
    frame.write_csv(messages)
    fourth = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert fourth.get("unchanged_from") is None
    assert fourth["requests_sent"] == 1
    assert sum(emulator.ledger.count_by_custom_id().values()) == asked + 1
    fifth = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert fifth["unchanged_from"] == fourth["run_id"] and fifth["requests_sent"] == 0
    shown = _published(tmp_path, "SELECT DISTINCT run_id FROM support_intents")
    assert shown == [(fourth["run_id"],)]


def test_a_changed_job_spec_is_not_an_unchanged_night(emulator: Emulator, tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5, replace=NO_EVAL_EACH_RUN)
    first = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert first["status"] == "completed"
    text = job.read_text()
    job.write_text(text.replace("sample_rate = 0.05", "sample_rate = 0.10"))
    second = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert second["status"] == "completed" and second.get("unchanged_from") is None


def test_eval_every_run_keeps_the_full_path(emulator: Emulator, tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5)  # the sample job asks its eval set each run
    enrich(job_file=str(job), emulator_url=emulator.base_url)
    second = enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert second.get("unchanged_from") is None
    assert second["requests_sent"] == 5  # the eval set, asked afresh; every row is cached


def test_the_cli_answers_an_unchanged_night_without_starting_prefect(
    emulator: Emulator, tmp_path: Path
) -> None:
    job = write_job(tmp_path, rows=30, eval_rows=5, replace=NO_EVAL_EACH_RUN)
    env = {"LOWTIDE_EMULATOR_URL": emulator.base_url, "COLUMNS": "200"}
    first = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    home = tmp_path / "prefect-home"  # a Prefect that starts would create its database here
    bare = {**env, "PREFECT_API_URL": "", "PREFECT_HOME": str(home)}
    second = lowtide_cli("run", str(job), cwd=tmp_path, env=bare)
    assert second.returncode == 0, second.stderr
    assert "Job and input unchanged since run" in second.stdout
    assert not home.exists()
    # identical nights do not grow the files: each adds one row to `runs`
    files = (tmp_path / "state.duckdb", tmp_path / "lowtide.duckdb")
    after_first = sum(f.stat().st_size for f in files)
    for _night in range(4):
        again = lowtide_cli("run", str(job), cwd=tmp_path, env=bare)
        assert again.returncode == 0 and "unchanged" in again.stdout, again.stderr
    assert sum(f.stat().st_size for f in files) <= 1.2 * after_first
    status = lowtide_cli("status", "--json", cwd=tmp_path, env=env)
    runs = orjson.loads(status.stdout)  # newest first
    assert len(runs) == 6
    first_run = runs[-1]
    assert first_run["unchanged_from"] is None and first_run["requests_sent"] > 0
    # every later night points at the run whose rows the view shows, and asked nothing
    assert {r["unchanged_from"] for r in runs[:-1]} == {first_run["run_id"]}
    assert {r["requests_sent"] for r in runs[:-1]} == {0}


def test_a_changed_night_chunks_and_asks_only_its_new_and_changed_rows(tmp_path: Path) -> None:
    """Rows unchanged since the shown run keep that run's units (copied, all cache hits); a new
    row, a changed row and a row that failed there go through chunk → dedupe, and only the new
    and changed ones are asked."""
    job = write_job(tmp_path, rows=40, eval_rows=5, replace=NO_EVAL_EACH_RUN)
    messages = tmp_path / "messages.csv"
    frame = pl.read_csv(messages, infer_schema=False)
    blank = pl.int_range(pl.len()) == 5  # no text: a row that fails with a reason
    frame.with_columns(pl.when(blank).then(pl.lit("")).otherwise("body").alias("body")).write_csv(
        messages
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=5)) as emu:
        first = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert (first["succeeded"], first["failed"]) == (39, 1)
        assert first["rows_carried"] == 0 and first["carried_from"] is None
        asked = sum(emu.ledger.count_by_custom_id().values())
        # an unchanged night between: the view then shows a run that points at the first
        unchanged = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert unchanged["unchanged_from"] == first["run_id"]

        frame = pl.read_csv(messages, infer_schema=False)
        changed_id, dropped_id = frame["message_id"][3], frame["message_id"][7]
        new_row = frame.head(1).with_columns(
            pl.lit("m999999").alias("message_id"),
            pl.lit("The courier left my parcel in the rain and it is soaked.").alias("body"),
        )
        changed = frame.with_columns(
            pl.when(pl.col("message_id") == changed_id)
            .then(pl.lit("Please cancel my subscription before the next renewal."))
            .otherwise("body")
            .alias("body")
        ).filter(pl.col("message_id") != dropped_id)
        pl.concat([changed, new_row]).write_csv(messages)

        second = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert second["status"] == "completed" and second.get("unchanged_from") is None
        # 40 rows: 37 unchanged and answered, the changed one, the blank one, the new one
        assert (second["carried_from"], second["rows_carried"]) == (first["run_id"], 37)
        assert second["requests_sent"] == 2
        assert sum(emu.ledger.count_by_custom_id().values()) == asked + 2
        assert (second["rows"], second["succeeded"], second["failed"]) == (40, 39, 1)
        # every distinct request but the two asked (eval set included) was answered before
        assert second["unique_requests"] == second["cache_hits"] + 2

    view = dict(
        _published(tmp_path, "SELECT message_id, body FROM support_intents ORDER BY message_id")
    )
    assert len(view) == 40 and dropped_id not in view
    assert view["m999999"].startswith("The courier") and view[changed_id].startswith("Please")
    shown = _published(tmp_path, "SELECT DISTINCT run_id FROM support_intents")
    assert shown == [(second["run_id"],)]
