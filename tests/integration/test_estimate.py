"""`lowtide estimate` quotes a run without paying for it, and the quote holds: checked against
the run that follows on the emulator (its billing ledger is the provider's view), and against
the budget guard that refuses a run before anything is sent."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from flows.enrich import enrich
from lowtide.cli import app
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.store import Store
from tests.integration.conftest import write_job

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

runner = CliRunner()
CONTRACT = {
    "rows",
    "units",
    "unique_requests",
    "cache_hits",
    "input_tokens",
    "output_tokens",
    "estimate_usd",
    "budget_usd",
    "by_backend",
}


def _estimate(job: Path) -> dict:
    result = runner.invoke(app, ["estimate", str(job), "--json"])
    assert result.exit_code == 0, result.output
    return orjson.loads(result.stdout)


def test_estimate_sends_nothing_and_quotes_the_run_that_follows(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=200)
    state = Path(os.environ["LOWTIDE_STATE"])
    with Emulator(EmulatorConfig(time_scale=600.0, seed=3)) as emu:
        quote = _estimate(job)
        assert CONTRACT <= set(quote)
        assert not state.exists()  # no state file, so no run either
        assert emu.ledger.executions() == [] and emu.ledger.errors() == []
        assert quote["rows"] == 200 and quote["cache_hits"] == 0
        assert quote["unique_requests"] == quote["requests_to_send"]
        assert quote["output_tokens_source"] == "examples"
        assert {"batch_usd", "realtime_usd"} <= set(quote["by_backend"]["emulator"])
        assert quote["estimate_usd"] == pytest.approx(quote["by_backend"]["emulator"]["batch_usd"])
        # the sample's stable prefix is below OpenAI's minimum: the quote says so, and the run
        # reads nothing from the provider's cache
        assert quote["prompt_cache"]["cached"] is False
        assert quote["prompt_cache"]["prefix_tokens"] < quote["prompt_cache"]["min_tokens"]

        first = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert first["status"] == "completed"
        assert first["unique_requests"] == quote["unique_requests"]
        assert first["units"] == quote["units"]
        assert quote["estimate_usd"] == pytest.approx(first["cost_usd"], rel=0.10)
        assert emu.ledger.total_usage()["cached_input_tokens"] == 0

        runs_before = Store(state).list_runs().height
        billed_before = len(emu.ledger.executions())
        again = _estimate(job)
        assert Store(state).list_runs().height == runs_before  # no run row created
        assert len(emu.ledger.executions()) == billed_before  # nothing sent
        # every row request comes from the cache now; only the eval set would be asked again
        row_requests = first["unique_requests"] - quote["eval_rows"]
        assert again["cache_hits"] >= row_requests - first["failed"]
        assert again["requests_to_send"] == again["unique_requests"] - again["cache_hits"]
        assert again["output_tokens_source"] == "observed"

        second = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert second["cache_hits"] == again["cache_hits"]
        assert again["estimate_usd"] == pytest.approx(second["cost_usd"], rel=0.10)


def test_a_cacheable_prefix_is_quoted_as_the_emulator_bills_it(tmp_path: Path) -> None:
    """A system prompt long enough for OpenAI's minimum: the quote's cached tokens per request
    are what the run reads from the emulated provider's cache after its first request, and the
    quote less what caching saves is what the run costs."""
    end = 'Reply with the JSON object only, no other text."""'
    notes = "\n".join(
        f"Policy note {i}: parcels from warehouse {i:03d} are handled by team {i % 7} "
        f"and reviewed on weekday {i % 5}."
        for i in range(90)
    )
    job = write_job(
        tmp_path,
        rows=30,
        eval_rows=4,
        replace={end: end.removesuffix('"""') + "\n\n" + notes + '"""'},
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=3)) as emu:
        quote = _estimate(job)
        cache = quote["prompt_cache"]
        assert cache["cached"] is True and cache["cached_tokens_per_request"] >= 1024
        run = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert run["status"] == "completed" and run["requests_sent"] == quote["requests_to_send"]
        billed = emu.ledger.total_usage()
        # one write, then every request reads the prefix: the quote's best case, met here
        expected = (run["requests_sent"] - 1) * cache["cached_tokens_per_request"]
        assert billed["cached_input_tokens"] == expected
        with_cache = quote["estimate_usd"] - cache["saved_usd"]
        assert with_cache == pytest.approx(run["cost_usd"], rel=0.10)
        assert quote["estimate_usd"] > 1.5 * run["cost_usd"]  # without caching: far off


def test_budget_refusal_names_the_key_and_sends_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=20, replace={"budget_usd = 5.0": "budget_usd = 0.0001"})
    with Emulator(EmulatorConfig(time_scale=600.0, seed=3)) as emu:
        monkeypatch.setenv("LOWTIDE_EMULATOR_URL", emu.base_url)
        result = runner.invoke(app, ["run", str(job)])
        assert result.exit_code == 2, result.output
        assert "[cost] budget_usd" in result.output
        assert "Traceback" not in result.output
        assert emu.ledger.executions() == [] and emu.ledger.errors() == []
    run = Store(os.environ["LOWTIDE_STATE"]).list_runs().row(0, named=True)
    assert run["status"] == "failed" and "[cost] budget_usd" in run["error"]
    assert run["estimate_usd"] > 0.0001
    assert f"${run['estimate_usd']:.4f}" in result.output  # the message names the estimate
