"""The command line as a user meets it: clear one-line errors, machine-readable status, the
emulator command printing what to export."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import openai
from typer.testing import CliRunner

from lowtide.cli import app

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
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            "ANTHROPIC_API_KEY" in line for line in lines
        ):
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
