"""Fixtures for whole-flow tests: a real emulator over HTTP, real Prefect, real DuckDB files."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from tests.conftest import SAMPLE_JOB


def lowtide_cli(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    inherit: bool = True,
) -> subprocess.CompletedProcess[str]:
    """`python -m lowtide.cli ARGS` in a subprocess, as a user (or a crash test) runs it: the
    test's environment plus `env`, and the session's Prefect server unless `env` says otherwise
    (a PREFECT_API_URL of "" means none: Prefect's temporary server). With `inherit=False`,
    `env` is the whole environment (a test that decides every variable, such as which keys
    exist)."""
    from prefect.settings import PREFECT_API_URL

    if inherit:
        full = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), **(env or {})}
        if not full["PREFECT_API_URL"]:
            del full["PREFECT_API_URL"]
    else:
        full = dict(env or {})
    return subprocess.run(
        [sys.executable, "-m", "lowtide.cli", *args],
        env=full,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_lowtide_run(
    job: Path, env: dict[str, str], cwd: Path, backend: str = "emulator"
) -> subprocess.Popen[str]:
    """`lowtide run JOB --backend BACKEND` started in the background, as a user's terminal
    starts it (output captured); the caller waits for it, signals or kills it."""
    return subprocess.Popen(
        [sys.executable, "-m", "lowtide.cli", "run", str(job), "--backend", backend],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def advance_clock(emu: Emulator, seconds: float) -> None:
    """Move the emulator's simulated clock forward (tests that freeze it, time_scale=0)."""
    import urllib.request

    urllib.request.urlopen(
        urllib.request.Request(
            f"{emu.base_url}/_emulator/clock/advance?seconds={seconds}", method="POST"
        )
    )


def cancel_through_cli(emu: Emulator, run_id: str) -> None:
    """`lowtide cancel RUN_ID` in-process against this emulator; it must succeed."""
    from typer.testing import CliRunner

    from lowtide.cli import app

    os.environ["LOWTIDE_EMULATOR_URL"] = emu.base_url
    try:
        result = CliRunner().invoke(app, ["cancel", run_id])
    finally:
        del os.environ["LOWTIDE_EMULATOR_URL"]
    assert result.exit_code == 0, result.output


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    with Emulator(EmulatorConfig(time_scale=600.0, seed=3)) as emu:
        yield emu


def write_job(
    tmp_path: Path,
    rows: int | None = None,
    eval_rows: int = 40,
    extra: str = "",
    replace: dict[str, str] | None = None,
) -> Path:
    """A copy of the sample job, optionally on the first `rows` messages, with absolute paths;
    `extra` TOML is appended (new sections) and `replace` edits the text (changed keys)."""
    data = SAMPLE_JOB.parent.parent
    spec = tomllib.loads(SAMPLE_JOB.read_text())
    messages = pl.read_csv(data / "support" / "messages.csv")
    if rows is not None:
        messages = messages.head(rows)
    messages.write_csv(tmp_path / "messages.csv")
    pl.read_csv(data / "support" / "eval.csv").head(eval_rows).write_csv(tmp_path / "eval.csv")
    lines = SAMPLE_JOB.read_text().splitlines()
    replaced = {
        spec["input"]["path"]: str(tmp_path / "messages.csv"),
        spec["output"]["schema_file"]: str(
            (SAMPLE_JOB.parent / spec["output"]["schema_file"]).resolve()
        ),
        spec["qa"]["eval_set"]: str(tmp_path / "eval.csv"),
        spec["cost"]["price_table"]: str(
            (SAMPLE_JOB.parent / spec["cost"]["price_table"]).resolve()
        ),
    }
    out = []
    for line in lines:
        for old, new in replaced.items():
            if (
                line.strip().startswith(("path", "schema_file", "eval_set", "price_table"))
                and f'"{old}"' in line
            ):
                line = line.replace(f'"{old}"', f'"{new}"')
        out.append(line)
    text = "\n".join(out) + "\n" + extra
    for old_text, new_text in (replace or {}).items():
        assert old_text in text, old_text
        text = text.replace(old_text, new_text)
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path
