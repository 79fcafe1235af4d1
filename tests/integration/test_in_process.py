"""The CLI without a configured Prefect server runs its flows in-process: no Prefect server is
started (none would show the run), nor is Prefect imported, every row still ends with an
outcome, and a stage's duration is still on record. With LOWTIDE_PREFECT_SERVER=temporary it
goes through Prefect's temporary server as before, and the run is in that server's database.
Real CLI processes, the emulator over HTTP, real DuckDB and SQLite files."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import orjson

from lowtide.emulator import Emulator
from tests.integration.conftest import lowtide_cli, write_job
from tests.integration.test_orphan_server import _servers_with_home

STAGES = {"load", "chunk", "dedupe", "assemble", "submit", "poll", "join", "parse", "publish"}


def _no_server(tmp_path: Path, emulator: Emulator, **extra: str) -> tuple[Path, dict[str, str]]:
    """A Prefect home of the test's own and an environment that configures no server."""
    home = tmp_path / "prefect-home"
    env = {
        "PREFECT_API_URL": "",
        "PREFECT_HOME": str(home),
        "LOWTIDE_EMULATOR_URL": emulator.base_url,
    }
    return home, env | extra


def _timings(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_a_run_without_a_server_starts_no_prefect_and_records_its_stages(
    emulator: Emulator, tmp_path: Path
) -> None:
    job = write_job(tmp_path, rows=25, eval_rows=4)
    timings = tmp_path / "stages.jsonl"
    home, env = _no_server(tmp_path, emulator, LOWTIDE_STAGE_TIMINGS=str(timings))
    done = lowtide_cli("run", str(job), cwd=tmp_path, env=env | {"PYTHONPROFILEIMPORTTIME": "1"})
    assert done.returncode == 0, done.stderr
    assert not (home / "prefect.db").exists()  # no Prefect server ever opened its database
    # nor was Prefect imported (~0.8 s of CPU for nothing): Python lists every module it did
    imported = {
        line.rpartition("|")[2].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert {"polars", "duckdb", "flows.enrich", "tasks.chunk"} <= imported
    assert not {m for m in imported if m.split(".")[0] == "prefect"}
    [run] = orjson.loads(lowtide_cli("status", "--json", cwd=tmp_path, env=env).stdout)
    assert run["status"] == "completed"
    assert run["rows"] == 25 and run["succeeded"] + run["failed"] == 25
    assert run["requests_sent"] > 0
    lines = _timings(timings)
    assert STAGES <= {line["name"] for line in lines}
    assert [line["name"] for line in lines if line["kind"] == "flow"] == ["enrich"]
    assert all(line["seconds"] >= 0 for line in lines)
    # each line carries the process's memory high-water mark so far (where a peak came from)
    assert all(line["peak_rss_mb"] > 0 for line in lines)
    assert any(line["run_name"] == f"publish-{run['run_id']}" for line in lines)


def test_no_wait_and_collect_without_a_server_finish_the_run(
    emulator: Emulator, tmp_path: Path
) -> None:
    job = write_job(tmp_path, rows=15, eval_rows=3)
    home, env = _no_server(tmp_path, emulator)
    submitted = lowtide_cli("run", str(job), "--no-wait", cwd=tmp_path, env=env)
    assert submitted.returncode == 0, submitted.stderr
    for _round in range(200):  # each collect polls once; the emulator's batches end meanwhile
        collected = lowtide_cli("collect", cwd=tmp_path, env=env)
        assert collected.returncode == 0, collected.stderr
        [run] = orjson.loads(lowtide_cli("status", "--json", cwd=tmp_path, env=env).stdout)
        if run["status"] == "completed":
            break
    assert run["status"] == "completed", run
    assert run["succeeded"] + run["failed"] == 15
    assert not (home / "prefect.db").exists()


def test_the_temporary_server_when_asked_records_the_run_in_prefect(
    emulator: Emulator, tmp_path: Path
) -> None:
    job = write_job(tmp_path, rows=10, eval_rows=2)
    home, env = _no_server(tmp_path, emulator, LOWTIDE_PREFECT_SERVER="temporary")
    done = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    with sqlite3.connect(home / "prefect.db") as con:
        flows = con.execute(
            "SELECT flow.name FROM flow_run JOIN flow ON flow.id = flow_run.flow_id"
        ).fetchall()
        tasks = con.execute("SELECT count(*) FROM task_run").fetchone()[0]
    assert flows == [("enrich",)]
    assert tasks >= len(STAGES)


_SAVE_BLOCK = """
import sys
from prefect.blocks.system import Secret

Secret(value=sys.argv[2]).save(sys.argv[1])
"""


def test_a_key_in_a_secret_block_is_read_through_a_tied_server(
    emulator: Emulator, tmp_path: Path
) -> None:
    """In-process, a job whose key is in a Prefect Secret block still gets it: the CLI starts
    Prefect's temporary server on the home's database for the block alone; no flow run is
    recorded there, and the server is gone when the CLI exits."""
    home = tmp_path / "prefect-home"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "PREFECT_API"))}
    base["PREFECT_HOME"] = str(home)
    # Prefect's own server migrates a new database first (~20 s here, its default limit): a
    # bound against a hang, not a speed check
    base["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "300"
    saved = subprocess.run(
        [sys.executable, "-c", _SAVE_BLOCK, "openai-key", "sk-from-block"],
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert saved.returncode == 0, saved.stderr
    job = write_job(
        tmp_path,
        rows=12,
        eval_rows=2,
        replace={"extra_body = {}\n": 'extra_body = {}\napi_key_block = "openai-key"\n'},
    )
    env = {**base, "OPENAI_BASE_URL": emulator.openai_base_url}
    done = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env, inherit=False)
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = orjson.loads(lowtide_cli("status", "--json", cwd=tmp_path, env=env).stdout)
    assert run["status"] == "completed" and run["succeeded"] == 12
    with sqlite3.connect(home / "prefect.db") as con:
        assert con.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 0
    assert not _servers_with_home(home)
