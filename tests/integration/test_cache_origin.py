"""No fake answer in a real run: the cross-run cache hands a run only answers of its own engine
family and model, never the emulator's to a real backend, and says where cached answers came
from. Real Prefect, the real OpenAI SDK over HTTP to the emulator, a real DuckDB file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from flows.enrich import enrich
from lowtide import render
from lowtide.backends import backend_entry
from lowtide.cli import app
from lowtide.emulator import Emulator, EmulatorConfig
from tests.integration.conftest import write_job

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


@pytest.fixture
def quiet_emulator() -> Iterator[Emulator]:
    """No injected errors, so every count below is exact."""
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=3)) as emu:
        yield emu


def _openai_at(emu: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `openai` backend's real SDK, pointed at the emulator with a fake key."""
    for variable, value in backend_entry("openai").emulator_env(emu.base_url).items():
        monkeypatch.setenv(variable, value)


def _status_json(run_id: str) -> dict:
    result = CliRunner().invoke(app, ["status", run_id, "--json"])
    assert result.exit_code == 0, result.output
    (record,) = orjson.loads(result.output)
    return record


def test_an_emulator_answered_cache_is_not_reused_by_an_openai_run_but_is_by_the_next(
    quiet_emulator: Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    emu = quiet_emulator
    job = write_job(tmp_path, rows=20, eval_rows=5)
    on_emulator = enrich(job_file=str(job), emulator_url=emu.base_url)
    assert on_emulator["status"] == "completed" and on_emulator["failed"] == 0
    assert on_emulator["cached_from"] == {}
    assert on_emulator["answered_by"] == {"emulator": on_emulator["unique_requests"]}
    asked_before = set(emu.ledger.count_by_custom_id())

    _openai_at(emu, monkeypatch)
    first = enrich(job_file=str(job), backend="openai")
    assert first["status"] == "completed" and first["backend"] == "openai"
    assert first["model"] == on_emulator["model"]  # the same model id on both
    # nothing answered by the emulator backend was taken: every request was sent
    assert first["cache_hits"] == 0 and first["cached_from"] == {}
    assert first["requests_sent"] == first["unique_requests"] == on_emulator["unique_requests"]
    asked = emu.ledger.count_by_custom_id()
    assert len(set(asked) - asked_before) == first["unique_requests"]
    assert set(asked.values()) == {1}
    # what answered is recorded from the answer itself: the emulator, behind the OpenAI SDK
    assert first["answered_by"] == {"emulator": first["unique_requests"]}

    second = enrich(job_file=str(job), backend="openai")
    assert second["status"] == "completed" and second["run_id"] != first["run_id"]
    # the same engine family and model: the rows come from the first openai run's answers;
    # only the eval set is asked afresh (it is answered in every run)
    row_requests = first["unique_requests"] - second["requests_sent"]
    assert second["requests_sent"] > 0 and second["cache_hits"] == row_requests > 0
    assert second["cached_from"] == {"emulator": second["cache_hits"]}
    after = emu.ledger.count_by_custom_id()
    assert all(after[k] == 1 for k in asked)  # nothing the first openai run got is paid again
    assert len(set(after) - set(asked)) == second["requests_sent"]

    with render.console.capture() as printed:  # what `lowtide run` prints
        render.run_summary(second)
    shown = " ".join(printed.get().split())
    assert "cached answers came from" in shown and f"emulator: {second['cache_hits']}" in shown
    assert "were given by lowtide's emulator" in shown

    status = _status_json(second["run_id"])
    assert status["cache_hits"] == second["cache_hits"]
    assert status["cached_from"] == {"emulator": second["cache_hits"]}
    assert status["answered_by"] == second["answered_by"]


def test_an_unfinished_emulator_run_is_not_resumed_by_an_openai_run(
    quiet_emulator: Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=10, eval_rows=5)
    with Emulator(EmulatorConfig(time_scale=0.0, error_rate=0.0)) as frozen:  # never finishes
        waiting = enrich(job_file=str(job), emulator_url=frozen.base_url, wait=False)
    assert waiting["status"] == "submitted"
    _openai_at(quiet_emulator, monkeypatch)
    on_openai = enrich(job_file=str(job), backend="openai")
    assert on_openai["run_id"] != waiting["run_id"] and on_openai["backend"] == "openai"
    # the emulator run's requests in flight are not attached to the openai run: all are sent
    assert on_openai["requests_sent"] == on_openai["unique_requests"]
    assert on_openai["status"] == "completed" and on_openai["cached_from"] == {}
    assert _status_json(waiting["run_id"])["status"] == "submitted"


def test_a_pool_of_emulated_vllm_engines_answers_as_the_emulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backend `vllm` is a real engine family, but these servers are the emulator's: what
    answered is recorded from the answers themselves, and the next run says so of its cache."""
    from lowtide.emulator.engine import EngineConfig
    from lowtide.emulator.vllm_pool import start_engines

    job = write_job(tmp_path, rows=10, eval_rows=3, extra="[pool]\ngpus = 1\n")
    model = "qwen2.5-7b-instruct"  # the sample job's model id for backend vllm
    with start_engines(1, EngineConfig(time_scale=10.0), served_model_name=model) as pool:
        monkeypatch.setenv("LOWTIDE_VLLM_URLS", ",".join(pool.urls))
        first = enrich(job_file=str(job), backend="vllm")
        second = enrich(job_file=str(job), backend="vllm")
    assert first["status"] == second["status"] == "completed" and first["failed"] == 0
    assert first["answered_by"] == {"emulator": first["unique_requests"]}
    assert second["cache_hits"] > 0
    assert second["cached_from"] == {"emulator": second["cache_hits"]}
