"""The command line as a user meets it: clear one-line errors, machine-readable status, the
emulator command printing what to export."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import openai
from typer.testing import CliRunner

from lowtide.cli import app
from lowtide.store import Store

runner = CliRunner()


def test_status_json_with_no_state_is_an_empty_list() -> None:
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0 and result.output.strip() == "[]"


def test_bad_job_file_is_one_clear_line(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('name = "x"\n[input]\npath = "in.csv"\n')
    result = runner.invoke(app, ["run", str(job)])
    assert result.exit_code == 2
    assert "error:" in result.output and str(job) in result.output
    assert "Traceback" not in result.output


def test_sql_without_a_published_file_says_what_to_do(tmp_path: Path) -> None:
    result = runner.invoke(app, ["sql", "SELECT 1", "--db", str(tmp_path / "none.duckdb")])
    assert result.exit_code == 2 and "run a job first" in result.output


def test_unknown_run_is_named() -> None:
    for command in (["publish", "nope"], ["cancel", "nope"], ["export", "nope"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2 and "nope" in result.output, command


def test_emulator_command_prints_what_to_export_and_serves() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowtide.cli", "emulator", "--port", "0", "--engines", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ},
    )
    try:
        # read up to the last variable it prints; the test's timeout bounds a hang
        lines: list[str] = []
        while not any("ANTHROPIC_API_KEY" in line for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        base = re.search(r"export OPENAI_BASE_URL=(\S+)", text)
        assert base, text
        assert "export LOWTIDE_VLLM_URLS=http://127.0.0.1:" in text
        client = openai.OpenAI(base_url=base.group(1), api_key="x")
        assert client.batches.list().data == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_collect_with_nothing_in_flight_answers_without_starting_prefect(tmp_path: Path) -> None:
    """The schedule runs `collect` every few minutes; with nothing in flight it answers from the
    state file alone: no Prefect server, no Prefect database, exit 0."""
    home = tmp_path / "prefect-home"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(home), "LOWTIDE_STATE": str(tmp_path / "none.duckdb")}
    done = subprocess.run(
        [sys.executable, "-m", "lowtide.cli", "collect"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "nothing in flight"
    assert not (home / "prefect.db").exists()
    assert not (tmp_path / "none.duckdb").exists()  # asking created no state file


_MODULES_AFTER_COLLECT = """
import sys
from lowtide.cli import main
sys.argv = ["lowtide", "collect"]
try:
    main()
except SystemExit as done:
    assert not done.code, done.code
print(sorted(m for m in ("polars", "pyarrow", "prefect") if m in sys.modules))
"""


def test_an_idle_collect_tick_loads_neither_polars_nor_prefect(tmp_path: Path) -> None:
    """With a state file and nothing in flight, `collect` answers with plain DuckDB: loading
    polars, pyarrow and Prefect was most of an idle tick's second and a half."""
    state = tmp_path / "state.duckdb"
    assert Store(state).in_flight_runs() == []  # a state file with its schema, no run
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "LOWTIDE_STATE": str(state)}
    done = subprocess.run(
        [sys.executable, "-c", _MODULES_AFTER_COLLECT],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["nothing in flight", "[]"]
