"""What an operator sees: the nightly deployment runs a (small) copy of the sample job through a
real Prefect server and worker, then headless Chromium opens the UI, finds the flow run, opens
its Artifacts tab and the run table, and reads the run's row count and cost there.

Screenshots are taken on every run, into the test's temp folder. The ones in docs/ are of the
product, not of this test: `docs/screenshots.py` makes them from `make serve` on the sample job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.store import Store
from tests.e2e.conftest import (
    NIGHTLY,
    Deployed,
    PrefectServer,
    Proc,
    chromium_executable,
    run_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = 200
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: the test's temp folder."""
    return tmp_path


@pytest.fixture
def browser_page() -> Iterator[Any]:
    """A page in headless Debian Chromium driven by Playwright (no downloaded browser)."""
    chromium = chromium_executable()
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="the playwright package is not installed (.ci/run installs it into .venv)",
    )
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def _usd(value: float) -> str:
    return f"${value:,.4f}"  # as lowtide.artifacts shows it


def _table_rows(data: object) -> list[dict[str, str]]:
    return json.loads(data) if isinstance(data, str) else list(data)  # type: ignore[call-overload]


def test_operator_reads_rows_and_cost_in_the_ui(
    prefect_server: PrefectServer,
    default_worker: Proc,
    small_job: Path,
    tmp_path: Path,
    browser_page: Any,
    shots: Path,
) -> None:
    from playwright.sync_api import expect

    with Emulator(EmulatorConfig(time_scale=600.0, seed=3)) as emu:
        flow_run_id = prefect_server.run_deployment(
            NIGHTLY, {"job_file": str(small_job)}, run_env(tmp_path, emu.base_url)
        )
        run = prefect_server.wait_for_terminal(flow_run_id, explain=lambda: default_worker.tail(60))
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"].startswith("support-intents-")  # named after the job and the date

    lowtide_run = Store(tmp_path / "state.duckdb").list_runs().row(0, named=True)
    assert lowtide_run["status"] == "completed"
    assert lowtide_run["rows"] == ROWS == lowtide_run["succeeded"] + lowtide_run["failed"]
    cost = _usd(lowtide_run["cost_usd"])

    # The same numbers through the API first, so that a UI failure reads as one.
    by_key = {a["key"]: a for a in prefect_server.artifacts(flow_run_id)}
    assert {"support-intents-run", "support-intents-report", "support-intents-progress"} <= set(
        by_key
    )
    table = {r["metric"]: r["value"] for r in _table_rows(by_key["support-intents-run"]["data"])}
    assert table["rows"] == f"{ROWS:,}" and table["cost"] == cost

    page = browser_page
    # Find the run in the runs list, as an operator would, and open it.
    page.goto(f"{prefect_server.url}/runs")
    page.get_by_role("link", name=run["name"], exact=True).first.click()
    page.wait_for_url(re.compile(rf"/runs/flow-run/{flow_run_id}"))
    expect(page.get_by_text("Completed").first).to_be_visible()

    # Its Artifacts tab: the run table's card carries the headline, rows and cost first.
    page.get_by_role("tablist").get_by_text("Artifacts", exact=True).click()
    card = page.locator("#artifacts-content").get_by_text(f"{ROWS:,} rows · cost {cost}")
    expect(card.first).to_be_visible()
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(shots / "ui-run-artifacts.png"), full_page=True)
    assert (shots / "ui-run-artifacts.png").stat().st_size > 20_000  # rendered, not blank

    # The table itself: one row for the row count, one for the cost.
    page.get_by_text("support-intents-run", exact=True).first.click()
    page.wait_for_url(re.compile(r"/artifacts/artifact/"))
    for metric, value in (("rows", f"{ROWS:,}"), ("cost", cost)):
        row = page.locator("tr").filter(
            has=page.locator("td").first.get_by_text(metric, exact=True)
        )
        expect(row).to_have_count(1)
        expect(row.locator("td").nth(1)).to_have_text(value)
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(shots / "ui-run-table.png"))

    # The markdown report, reached from the same tab.
    page.go_back()
    page.wait_for_url(re.compile(rf"/runs/flow-run/{flow_run_id}"))
    page.get_by_role("tablist").get_by_text("Artifacts", exact=True).click()
    page.get_by_text("support-intents-report", exact=True).first.click()
    expect(page.get_by_text(f"of {ROWS:,} rows succeeded", exact=False).first).to_be_visible()
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(shots / "ui-run-report.png"))


def test_deployments_page_shows_the_schedules(
    deployed: Deployed, default_worker: Proc, browser_page: Any, shots: Path
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    page.goto(f"{deployed.server.url}/deployments")
    for name in ("nightly-support-intents", "collect-in-flight"):
        expect(page.get_by_role("link", name=name, exact=True).first).to_be_visible()
    expect(page.get_by_text("At 02:00 AM every day").first).to_be_visible()  # cron, in words
    expect(page.get_by_text("Ready", exact=True).first).to_be_visible()  # a worker is polling
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(shots / "ui-deployments.png"))

    page.get_by_role("link", name="collect-in-flight", exact=True).first.click()
    expect(page.get_by_text("Every 5 minutes").first).to_be_visible()
