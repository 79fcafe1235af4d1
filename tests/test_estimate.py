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
from lowtide.tokens import count_tokens
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


# -- the prompt cache ----------------------------------------------------------------------------

LONG_PROMPT_END = 'Reply with the JSON object only, no other text."""'
POLICY_NOTES = "\n".join(
    f"Policy note {i}: parcels from warehouse {i:03d} are handled by team {i % 7} "
    f"and reviewed on weekday {i % 5}."
    for i in range(90)
)
LONG_PROMPT = {LONG_PROMPT_END: LONG_PROMPT_END.removesuffix('"""') + "\n\n" + POLICY_NOTES + '"""'}


def _prefix_tokens(job: Path) -> int:
    """System prompt and few-shot turns, each with lowtide's 4 tokens of chat framing."""
    prompt = load_job(job).prompt
    texts = [prompt.system] + [t for e in prompt.examples for t in (e.user, e.assistant)]
    return sum(count_tokens(t) + 4 for t in texts)


def test_a_short_stable_prefix_will_not_be_cached(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=10, eval_rows=5)
    prefix = _prefix_tokens(job)
    assert 700 < prefix < 1024  # the sample: ~525-token system prompt and three examples
    on_haiku = _quote(job, "anthropic")["prompt_cache"]
    assert on_haiku == {
        "prefix_tokens": prefix,
        "provider": "Anthropic",
        "model": "claude-haiku-4-5",
        "min_tokens": 4096,
        "cached": False,
        "cached_tokens_per_request": 0,
        "saved_usd": 0.0,
    }
    on_emulator = _quote(job)["prompt_cache"]  # it speaks OpenAI and caches by OpenAI's rules
    assert (on_emulator["provider"], on_emulator["min_tokens"]) == ("OpenAI", 1024)
    assert on_emulator["cached"] is False and on_emulator["saved_usd"] == 0.0
    out = runner.invoke(app, ["estimate", str(job), "--backend", "anthropic"]).output
    assert (
        f"the stable prefix is {prefix:,} tokens, below Anthropic's minimum of 4,096 for "
        "claude-haiku-4-5: it will not be cached"
    ) in " ".join(out.split())
    assert not any("prompt cache" in note for note in _quote(job)["assumptions"])


def test_a_long_stable_prefix_says_what_caching_saves(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        rows=30,
        eval_rows=5,
        replace={**LONG_PROMPT, '"claude-haiku-4-5"': '"claude-sonnet-4-5"'},
    )
    prefix = _prefix_tokens(job)
    q = _quote(job)
    cache, n = q["prompt_cache"], q["requests_to_send"]
    cached = prefix // 128 * 128  # OpenAI reads back whole 128-token steps
    assert cache["cached"] is True and cache["cached_tokens_per_request"] == cached
    # one write at no premium, n - 1 reads at the cached-input price, all at the batch price
    assert cache["saved_usd"] == pytest.approx((n - 1) * cached * (0.15 - 0.075) / 1e6 * 0.5)
    assert 0 < cache["saved_usd"] < q["estimate_usd"]
    assert any("prompt cache: one cache write" in note for note in q["assumptions"])

    sonnet = _quote(job, "anthropic")["prompt_cache"]  # Sonnet 4.5 caches from 1,024 tokens
    assert (sonnet["min_tokens"], sonnet["cached_tokens_per_request"]) == (1024, prefix)
    reads = (n - 1) * prefix * (3.00 - 0.30)
    write = prefix * 0.25 * 3.00  # a write costs 1.25 times the input price
    assert sonnet["saved_usd"] == pytest.approx((reads - write) / 1e6 * 0.5)

    result = runner.invoke(app, ["estimate", str(job), "--json"])
    assert orjson.loads(result.stdout)["prompt_cache"] == cache
    text = " ".join(runner.invoke(app, ["estimate", str(job)]).output.split())
    assert (
        f"the stable prefix is {prefix:,} tokens, enough for OpenAI's minimum of 1,024 for "
        f"gpt-4o-mini: each later request reads {cached:,} of them from cache, saving up to "
        f"${cache['saved_usd']:.4f} on this job"
    ) in text


def test_a_model_without_a_known_minimum_is_said_so(tmp_path: Path) -> None:
    job = write_job(
        tmp_path, rows=5, eval_rows=5, replace={'"claude-haiku-4-5"': '"claude-unpriced"'}
    )
    cache = _quote(job, "anthropic")["prompt_cache"]
    assert cache["min_tokens"] is None and cache["cached"] is False
    assert cache["saved_usd"] is None  # no price row either
    out = " ".join(
        runner.invoke(app, ["estimate", str(job), "--backend", "anthropic"]).output.split()
    )
    assert "Anthropic's minimum for claude-unpriced is not in lowtide's table" in out


def test_a_job_without_examples_has_the_system_prompt_as_its_prefix(tmp_path: Path) -> None:
    text = write_job(tmp_path, rows=5, eval_rows=5).read_text()
    cut = text.index("[[prompt.examples]]")
    job = tmp_path / "no-examples.toml"
    job.write_text(text[:cut] + text[text.index("[output]") :])
    assert load_job(job).prompt.examples == []
    system = load_job(job).prompt.system
    assert _quote(job)["prompt_cache"]["prefix_tokens"] == count_tokens(system) + 4
