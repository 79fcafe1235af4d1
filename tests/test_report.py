"""`lowtide report` and the run report's charts, drawn from a real state file.

A small copy of the sample job runs three times against the emulator over HTTP (real Prefect,
real DuckDB): a first run; a run on more rows against an emulator that breaks most answers and
errors often, with retries and re-asks off (so rows fail, for more than one reason); and the same
input again (so the rows come from the cache). The charts are then checked
the way a reader checks them: one picture per question, and the numbers printed on the bars are
the numbers `lowtide status` shows for those runs. The page is opened in headless Chromium with
the network cut off.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lowtide.artifacts import history_charts_of, run_report_markdown
from lowtide.charts import Chart, history_charts, pct, usd
from lowtide.cli import app
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.errors import RunHeldError
from lowtide.report_html import report_html
from lowtide.store import JobHistory, Store
from lowtide.store.history import published_history
from tests.integration.conftest import write_job

JOB = "support-intents"
CHART_KEYS = ["cost", "eval", "failures", "savings"]
runner = CliRunner()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, prefect_harness: None) -> Iterator[Path]:
    """A folder with state.duckdb and lowtide.duckdb after three runs of the job."""
    from flows.enrich import enrich

    tmp = tmp_path_factory.mktemp("report")
    paths = {"state": str(tmp / "state.duckdb"), "db": str(tmp / "lowtide.duckdb")}
    with pytest.MonkeyPatch.context() as mp:  # the autouse clean_env is per test, not per module
        for name in [n for n in os.environ if n.startswith("LOWTIDE_")]:
            mp.delenv(name)
        mp.setenv("LOWTIDE_WORK_DIR", str(tmp / "work"))
        fragile = "[retry]\nmax_attempts = 1\nrealtime_fallback = false\nreask = false\n"
        runs = (
            (40, "", EmulatorConfig(time_scale=600.0, seed=3)),
            (
                70,
                fragile,
                EmulatorConfig(time_scale=600.0, seed=5, malformed_rate=0.9, error_rate=0.3),
            ),
            (70, "", EmulatorConfig(time_scale=600.0, seed=7)),
        )
        for rows, extra, config in runs:
            job = write_job(tmp, rows=rows, eval_rows=20, extra=extra)
            with Emulator(config) as emu:
                try:
                    summary = enrich(job_file=str(job), emulator_url=emu.base_url, **paths)
                except RunHeldError as held:  # the fragile night: too many failed rows
                    summary = held.summary
            assert summary["status"] in ("completed", "held"), summary
    yield tmp


@pytest.fixture(scope="module")
def history(files: Path) -> JobHistory:
    return Store(files / "state.duckdb").job_history(JOB)


@pytest.fixture(scope="module")
def charts(history: JobHistory) -> dict[str, Chart]:
    return {c.key: c for c in history_charts(history)}


def _status(files: Path) -> list[dict]:
    """The runs as `lowtide status` and the run summary report them, oldest first."""
    store = Store(files / "state.duckdb")
    ids = reversed(store.list_runs()["run_id"].to_list())
    return [store.run_summary(run_id) for run_id in ids]


def test_history_is_the_runs_as_status_shows_them(files: Path, history: JobHistory) -> None:
    runs = _status(files)
    assert history.runs["run_id"].to_list() == [r["run_id"] for r in runs]
    for row, run in zip(history.runs.iter_rows(named=True), runs, strict=True):
        assert row["cost_usd"] == pytest.approx(run["cost_usd"])
        assert row["realtime_cost_usd"] == pytest.approx(run["realtime_cost_usd"])
        assert row["cache_savings_usd"] == pytest.approx(run["metrics"]["cache_savings_usd"])
        failures = history.failures.filter(history.failures["run_id"] == run["run_id"])
        assert dict(failures.select("reason", "rows").iter_rows()) == run["failures_by_reason"]
        evals = history.evals.filter(history.evals["run_id"] == run["run_id"])
        assert dict(evals.select("field", "accuracy").iter_rows()) == run["eval_by_field"]
    # the three runs show what the charts are for: rows failed in the second, the cache
    # answered the third
    assert runs[1]["failed"] > 0 and runs[0]["failed"] == 0
    assert runs[2]["cache_hits"] > 0 and runs[2]["cost_usd"] < runs[0]["cost_usd"]


def test_one_chart_per_question_with_the_runs_numbers_on_it(
    history: JobHistory, charts: dict[str, Chart]
) -> None:
    assert list(charts) == CHART_KEYS
    for chart in charts.values():
        assert chart.svg.startswith("<svg") and chart.svg.count("<svg") == 1
        assert chart.title in chart.svg  # the title is text a reader (and a search) finds
    for run in history.runs.iter_rows(named=True):
        assert usd(run["cost_usd"]) in charts["cost"].svg
        assert usd(run["realtime_cost_usd"]) in charts["cost"].svg
        saved = run["dedupe_savings_usd"] + run["cache_savings_usd"]
        assert usd(saved) in charts["savings"].svg
    for e in history.evals.iter_rows(named=True):
        assert e["field"] in charts["eval"].svg and pct(e["accuracy"]) in charts["eval"].svg
    for f in history.failures.iter_rows(named=True):
        assert f["reason"] in charts["failures"].svg
        assert f">{f['rows']}<" in charts["failures"].svg  # the bar's label


def test_same_history_same_svg(history: JobHistory, charts: dict[str, Chart]) -> None:
    """Stable output: a report regenerated from the same state is the same file."""
    again = {c.key: c.svg for c in history_charts(history)}
    assert again == {k: c.svg for k, c in charts.items()}


def test_a_job_without_failures_or_evals_still_gets_every_chart(history: JobHistory) -> None:
    quiet = JobHistory(JOB, history.runs.head(1), history.evals.clear(), history.failures.clear())
    drawn = {c.key: c.svg for c in history_charts(quiet)}
    assert list(drawn) == CHART_KEYS
    assert "no failed rows in these runs" in drawn["failures"]
    assert "no eval set was scored in these runs" in drawn["eval"]


def test_the_page_holds_the_charts_and_loads_nothing(
    history: JobHistory, charts: dict[str, Chart]
) -> None:
    html = report_html(history, list(charts.values()))
    assert html.count("<svg") == len(CHART_KEYS)
    for key, chart in charts.items():
        assert f'id="chart-{key}"' in html and chart.svg in html
    for run_id in history.runs["run_id"]:
        assert run_id in html
    # offline: no script, stylesheet, image, frame or font, and no link to fetch one from
    # (`url(#id)` is a reference inside the page; the SVG namespaces are names, never fetched)
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\((?!#)", html)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", html)


def test_report_command_from_the_state_file_or_the_published_file(
    files: Path, history: JobHistory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LOWTIDE_STATE", str(files / "state.duckdb"))
    out = tmp_path / "out" / "report.html"
    result = runner.invoke(app, ["report", JOB, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "3 run(s)" in result.output and out.is_file()
    assert out.read_text() == report_html(history)

    from_db = tmp_path / "from-db.html"
    args = ["report", JOB, "--db", str(files / "lowtide.duckdb"), "--out", str(from_db)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert from_db.read_text() == out.read_text()  # the analysts' copy tells the same story
    assert published_history(files / "lowtide.duckdb", JOB, 1).runs.height == 1


def test_report_of_an_unknown_job_is_one_line_naming_the_known_ones(
    files: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LOWTIDE_STATE", str(files / "state.duckdb"))
    result = runner.invoke(app, ["report", "nope", "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0, result.output
    assert "'nope'" in result.output and JOB in result.output
    assert not (tmp_path / "r.html").exists()


def test_report_without_a_state_file_says_what_to_do(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", JOB, "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 2 and "run a job first" in result.output


def test_run_report_artifact_shows_the_charts_as_images(
    files: Path, history: JobHistory, charts: dict[str, Chart]
) -> None:
    last = _status(files)[-1]
    summary = {**last, "state": str(files / "state.duckdb")}
    drawn = history_charts_of(summary)
    assert [c.svg for c in drawn] == [c.svg for c in charts.values()]
    markdown = run_report_markdown(summary, drawn)
    images = re.findall(r"!\[([^\]]+)\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", markdown)
    assert [title for title, _ in images] == [c.title for c in charts.values()]
    assert [base64.b64decode(b).decode() for _, b in images] == [c.svg for c in charts.values()]
    assert history_charts_of({"job": JOB}) == []  # no state file named: no history section
    assert "## History" not in run_report_markdown({"job": JOB})


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


def test_the_report_renders_in_headless_chromium(
    history: JobHistory, charts: dict[str, Chart], tmp_path: Path
) -> None:
    from tests.e2e.conftest import chromium_executable

    chromium = chromium_executable()  # skips, saying why, without Chromium
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="the playwright package is not installed (.ci/run installs it into .venv)",
    )
    page_file = tmp_path / "report.html"
    page_file.write_text(report_html(history, list(charts.values())), encoding="utf-8")
    asked: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS, headless=True)
        try:
            context = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.on("request", lambda r: asked.append(r.url))
            page.goto(page_file.as_uri())
            page.wait_for_load_state("load")
            drawn = page.evaluate(
                """() => Array.from(document.querySelectorAll('figure[data-chart]')).map(f => {
                    const svg = f.querySelector('svg'); const box = svg.getBoundingClientRect();
                    return {key: f.dataset.chart, width: box.width, height: box.height,
                            bars: svg.querySelectorAll('path, rect, use').length,
                            text: svg.textContent};
                })"""
            )
            page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        finally:
            browser.close()
    assert asked == [page_file.as_uri()]  # the page itself, nothing else
    assert [d["key"] for d in drawn] == CHART_KEYS
    for d in drawn:
        assert d["width"] > 300 and d["height"] > 100, d  # laid out, not collapsed
        assert d["bars"] > 10, d
    last = history.runs.row(-1, named=True)
    cost_text = next(d["text"] for d in drawn if d["key"] == "cost")
    assert usd(last["cost_usd"]) in cost_text  # what the browser shows, not only the file
    assert (tmp_path / "report.png").stat().st_size > 30_000  # rendered, not blank
