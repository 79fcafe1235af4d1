"""The quote before a run (`tasks/estimate.py`, `lowtide estimate`): counted as a run counts,
priced on every backend with a price, and nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from lowtide.cli import app
from lowtide.jobspec import load_job
from lowtide.planner import DEFAULT_TOKENS_PER_S
from lowtide.pricing import load_price
from lowtide.settings import Settings
from lowtide.store import Store
from tasks.assemble import estimate_usd
from tasks.estimate import estimate_job, model_name_for
from tests.integration.conftest import write_job

runner = CliRunner()
TINY_BUDGET = {"budget_usd = 5.0": "budget_usd = 0.0001"}


def _quote(job: Path, backend: str | None = None) -> dict:
    return estimate_job(load_job(job, backend), Settings(), backend)


def test_quote_counts_like_a_run_and_writes_nothing(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=30, eval_rows=10)
    q = _quote(job)
    assert not Path(os.environ["LOWTIDE_STATE"]).exists()
    assert (q["rows"], q["eval_rows"]) == (30, 10)
    assert q["units"] >= 30
    assert q["cache_hits"] == q["in_flight"] == 0
    assert q["unique_requests"] == q["requests_to_send"] <= q["units"] + 10
    assert q["output_tokens_source"] == "examples"
    assert q["output_tokens"] == q["requests_to_send"] * q["expected_output_tokens_per_request"]
    assert q["observed_output_tokens_per_request"] is None
    # the same figure the run's budget guard computes (tasks/assemble.py)
    spec = load_job(job)
    price = load_price(spec.resolve(spec.cost.price_table), "emulator", "gpt-4o-mini")
    guard = estimate_usd(spec, q["input_tokens"], q["requests_to_send"], 0, price.per_mtok())
    assert q["estimate_usd"] == pytest.approx(guard)
    assert q["budget_usd"] == 5.0 and q["over_budget"] is False


def test_every_token_priced_backend_with_its_own_model(tmp_path: Path) -> None:
    q = _quote(write_job(tmp_path, rows=10, eval_rows=5))
    by = q["by_backend"]
    assert by["emulator"]["model"] == by["openai"]["model"] == "gpt-4o-mini"
    assert by["anthropic"]["model"] == "claude-haiku-4-5"
    for cost in by.values():
        assert cost["realtime_usd"] == pytest.approx(2 * cost["batch_usd"])  # discount 0.5
    assert by["anthropic"]["batch_usd"] > by["openai"]["batch_usd"]
    assert "vllm" not in by and "[pool] gpu_hour_usd" in q["skipped"]["vllm"]


def test_a_backend_without_a_price_row_is_skipped_and_named(tmp_path: Path) -> None:
    job = write_job(
        tmp_path, rows=10, eval_rows=5, replace={'"claude-haiku-4-5"': '"claude-unpriced"'}
    )
    q = _quote(job)
    assert "anthropic" not in q["by_backend"]
    assert "claude-unpriced" in q["skipped"]["anthropic"]
    chosen = _quote(job, "anthropic")
    assert chosen["backend"] == "anthropic" and chosen["estimate_usd"] is None
    assert chosen["over_budget"] is False


def test_backend_option_quotes_that_backend(tmp_path: Path) -> None:
    q = _quote(write_job(tmp_path, rows=10, eval_rows=5), "anthropic")
    assert (q["backend"], q["model"]) == ("anthropic", "claude-haiku-4-5")
    assert q["estimate_usd"] == pytest.approx(q["by_backend"]["anthropic"]["batch_usd"])


def test_model_names_when_the_job_runs_on_a_mapped_backend(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path, rows=5, eval_rows=5), "anthropic")
    assert job.model.name == "claude-haiku-4-5"
    assert model_name_for(job, "openai") == "gpt-4o-mini"  # `[model] name`, read back
    assert model_name_for(job, "vllm") == "qwen2.5-7b-instruct"


@pytest.mark.parametrize(
    ("pool", "servers", "tps", "source"),
    [
        ("gpus = 2\n", 2, DEFAULT_TOKENS_PER_S, "planner's default"),
        ('gpus = 2\nurls = ["http://a:8000/v1"]\ntokens_per_s = 1000\n', 1, 1000.0, "[pool]"),
    ],
)
def test_the_pool_is_priced_by_gpu_time(
    tmp_path: Path, pool: str, servers: int, tps: float, source: str
) -> None:
    job = write_job(tmp_path, rows=10, eval_rows=5, extra=f"[pool]\ngpu_hour_usd = 2.5\n{pool}")
    q = _quote(job)
    wall_h = q["output_tokens"] / (tps * servers) / 3600
    assert q["by_backend"]["vllm"] == pytest.approx(wall_h * 2.5 * 2)
    assert any(source in note and f"{tps:g}" in note for note in q["assumptions"])


def test_over_budget_is_flagged(tmp_path: Path) -> None:
    q = _quote(write_job(tmp_path, rows=10, eval_rows=5, replace=TINY_BUDGET))
    assert q["budget_usd"] == 0.0001 and q["over_budget"] is True


def test_no_history_in_an_empty_state_file(tmp_path: Path) -> None:
    store = Store(tmp_path / "empty.duckdb")
    assert store.observed_output_tokens("support-intents") == {
        "mean": None,
        "requests": 0,
        "runs": 0,
    }


def test_cli_json_has_the_contract_fields(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=10, eval_rows=5)
    result = runner.invoke(app, ["estimate", str(job), "--json"])
    assert result.exit_code == 0, result.output
    q = orjson.loads(result.stdout)
    assert {
        "rows",
        "units",
        "unique_requests",
        "cache_hits",
        "input_tokens",
        "output_tokens",
        "estimate_usd",
        "budget_usd",
        "by_backend",
    } <= set(q)
    assert not Path(os.environ["LOWTIDE_STATE"]).exists()


def test_cli_table_and_one_line_errors(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=10, eval_rows=5, replace=TINY_BUDGET)
    result = runner.invoke(app, ["estimate", str(job)])
    assert result.exit_code == 0, result.output
    assert "requests to send" in result.output and "anthropic" in result.output
    assert "not priced: vllm" in result.output
    assert "[cost] budget_usd" in result.output  # markup escaped, brackets printed
    bad = runner.invoke(app, ["estimate", str(job), "--backend", "nope"])
    assert bad.exit_code == 2 and "unknown backend 'nope'" in bad.output
    assert "Traceback" not in bad.output
