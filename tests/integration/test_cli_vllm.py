"""`lowtide run --backend vllm` as a user types it, against emulated vLLM engines: the sample
job runs on engines started with their default served names, and a run whose every request is
refused exits 1 with the reason on one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from lowtide.cli import app
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.vllm_pool import start_engines
from tests.integration.conftest import write_job
from tests.sql import query

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

runner = CliRunner()


def _run(job: Path, served_model_name: str | None, monkeypatch: pytest.MonkeyPatch) -> Result:
    kw = {} if served_model_name is None else {"served_model_name": served_model_name}
    with start_engines(2, EngineConfig(time_scale=50.0), **kw) as pool:
        monkeypatch.setenv("LOWTIDE_VLLM_URLS", ",".join(pool.urls))
        return runner.invoke(app, ["run", str(job), "--backend", "vllm"])


def test_the_sample_job_runs_on_engines_serving_the_default_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5)  # [model] names.vllm as the sample job's
    result = _run(job, None, monkeypatch)
    assert result.exit_code == 0, result.output
    runs = query(os.environ["LOWTIDE_STATE"], "SELECT status, model, rows, succeeded FROM runs")
    assert runs.rows(named=True) == [
        {"status": "completed", "model": "qwen2.5-7b-instruct", "rows": 20, "succeeded": 20}
    ]


def test_a_run_whose_every_request_is_refused_exits_1_with_the_reason_on_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=12, eval_rows=3, extra="[retry]\nmax_attempts = 1\n")
    result = _run(job, "some-other-model", monkeypatch)
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.splitlines()  # nothing else on stderr, not even an empty line
    assert line.startswith("error: every row of run ")
    assert "failed (12 of 12); main reason: provider_error (12 rows): HTTP 404" in line
    assert "The model `qwen2.5-7b-instruct` does not exist" in line
    assert "Valid aliases: some-other-model" in line
    runs = query(os.environ["LOWTIDE_STATE"], "SELECT status, failed FROM runs")
    assert runs.rows() == [("failed", 12)]  # every row failed with its reason: not published
