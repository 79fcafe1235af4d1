"""Each answered request's price, as stored in `results`: set as parse stores the batch, and
checked again by reconcile, which mends a price that is missing or differs from its own."""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest

from flows.enrich import enrich
from lowtide.context import run_context
from lowtide.jobspec import load_job
from lowtide.settings import Settings
from lowtide.store import Store
from tasks.reconcile import reconcile_task, request_costs
from tests.integration.conftest import write_job
from tests.sql import query, scalar

pytestmark = pytest.mark.usefixtures("prefect_harness")

_PRICED = (
    "SELECT custom_id, channel, input_tokens, cached_tokens, output_tokens, cost_usd "
    "FROM results WHERE run_id = ? ORDER BY custom_id"
)


def _own_prices(results: pl.DataFrame, job_file: Path, url: str) -> pl.Series:
    with run_context(Settings(), load_job(job_file), url) as ctx:
        return request_costs(results.drop("cost_usd"), ctx.price)["cost_usd"]


def test_results_priced_when_stored_and_a_wrong_price_mended(
    emulator, clean_env: Path, tmp_path: Path
) -> None:
    job_file = write_job(tmp_path, rows=300)
    run_id = enrich(job_file=str(job_file), emulator_url=emulator.base_url)["run_id"]
    store = Store(os.environ["LOWTIDE_STATE"])
    results = query(store, _PRICED, [run_id])
    assert results.height > 0 and results["cost_usd"].null_count() == 0
    expected = _own_prices(results, job_file, emulator.base_url)
    assert results["cost_usd"].to_list() == pytest.approx(expected.to_list(), rel=1e-12)
    run_cost = scalar(
        store, "SELECT cost_usd FROM costs WHERE run_id = ? AND level = 'run'", [run_id]
    )
    assert run_cost == pytest.approx(results["cost_usd"].sum(), rel=1e-12)

    # one price lost, one wrong (a price table edited between the two, a crash between them)
    lost, wrong = results["custom_id"][0], results["custom_id"][1]
    scalar(store, "UPDATE results SET cost_usd = NULL WHERE custom_id = ?", [lost])
    scalar(store, "UPDATE results SET cost_usd = 99.0 WHERE custom_id = ?", [wrong])
    with run_context(Settings(), load_job(job_file), emulator.base_url) as ctx:
        reconcile_task(ctx, run_id)
    mended = query(store, _PRICED, [run_id])
    assert mended["cost_usd"].to_list() == pytest.approx(expected.to_list(), rel=1e-12)
