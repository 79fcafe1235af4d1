"""`lowtide report`: a job's history as one self-contained HTML page.

The page holds the charts of `lowtide.charts` as inline SVG and a table of the same runs' numbers.
It loads nothing: no script, no stylesheet, font or image from elsewhere, so it opens offline,
from an e-mail attachment, or from a CI artifact.
"""

from __future__ import annotations

from datetime import datetime
from html import escape
from typing import Any

from lowtide.charts import Chart, history_charts, pct, usd
from lowtide.store.history import JobHistory

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1b1f24;
       background: #f6f7f9; margin: 0; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 22px; margin: 0 0 4px; }
.lead { color: #4a5360; margin: 0 0 20px; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 16px; }
figure { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; margin: 0;
         padding: 8px; }
figure svg { display: block; width: 100%; height: auto; }
figcaption { color: #4a5360; font-size: 12px; padding: 4px 6px 0; }
h2 { font-size: 16px; margin: 28px 0 8px; }
.table { overflow-x: auto; }
table { border-collapse: collapse; background: #fff; font-size: 12px; width: 100%; }
th, td { border: 1px solid #dde1e6; padding: 4px 6px; text-align: right; white-space: nowrap; }
th { background: #eef0f3; white-space: normal; vertical-align: bottom; }
td:first-child, th:first-child, td.text { text-align: left; }
"""

CAPTIONS = {
    "cost": "What the provider billed, next to the same tokens at the realtime list price "
    "(runs.cost_usd and runs.realtime_cost_usd): the gap is the batch discount.",
    "eval": "Share of the eval set answered correctly, per output field (eval_scores). "
    "A drop under the same model name is a model that changed.",
    "failures": "Input rows that ended failed, by reason (failures). Each has its reason and "
    "detail in the published file.",
    "savings": "Realtime dollars not spent because identical units were asked once (dedupe) and "
    "because earlier runs had already answered a request (cache); metrics *_savings_usd.",
}

_COLUMNS = (
    ("run", "run_id"),
    ("started (UTC)", "started_at"),
    ("status", "status"),
    ("backend", "backend"),
    ("rows", "rows"),
    ("failed", "failed"),
    ("requests sent", "requests_sent"),
    ("cache hits", "cache_hits"),
    ("cost", "cost_usd"),
    ("realtime price", "realtime_cost_usd"),
    ("realtime, no dedupe, no cache", "naive_cost_usd"),
    ("saved by dedupe", "dedupe_savings_usd"),
    ("saved by cache", "cache_savings_usd"),
)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column.endswith("_usd"):
        return usd(float(value))
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _runs_table(history: JobHistory) -> str:
    runs = history.runs
    fields = sorted(set(history.evals["field"])) if history.evals.height else []
    accuracy = {(r, f): a for r, f, a in history.evals.select("run_id", "field", "accuracy").rows()}
    head = "".join(f"<th>{escape(label)}</th>" for label, _ in _COLUMNS)
    head += "".join(f"<th>accuracy: {escape(f)}</th>" for f in fields)
    body = []
    prefix = f"{history.job}-"
    for run in reversed(runs.to_dicts()):  # newest first, as `lowtide status` lists them
        run_id = str(run["run_id"])
        short = run_id.removeprefix(prefix)  # the job is the page's title
        cells = f'<td class="text" title="{escape(run_id)}">{escape(short)}</td>'
        cells += "".join(
            f'<td class="text">{escape(_cell(c, run[c]))}</td>'
            if c in ("status", "backend")
            else f"<td>{escape(_cell(c, run[c]))}</td>"
            for _, c in _COLUMNS[1:]
        )
        for f in fields:
            a = accuracy.get((run["run_id"], f))
            cells += f"<td>{'' if a is None else pct(a)}</td>"
        body.append(f"<tr>{cells}</tr>")
    return (
        f'<div class="table"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _figure(chart: Chart) -> str:
    return (
        f'<figure id="chart-{chart.key}" data-chart="{chart.key}">{chart.svg}'
        f"<figcaption>{escape(CAPTIONS[chart.key])}</figcaption></figure>"
    )


def report_html(history: JobHistory, charts: list[Chart] | None = None) -> str:
    """The whole page for the job's history (the charts are drawn unless given)."""
    charts = history_charts(history) if charts is None else charts
    runs = history.runs
    first, last = runs["started_at"].min(), runs["started_at"].max()
    span = (
        f"{runs.height} finished run{'s' if runs.height != 1 else ''}, "
        f"{_cell('started_at', first)} to {_cell('started_at', last)} UTC"
    )
    total = float(runs["cost_usd"].sum())
    saved = float((runs["naive_cost_usd"] - runs["cost_usd"]).sum())
    title = f"{history.job}: run history"
    return (
        "<!doctype html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{_CSS}</style></head><body><main>"
        f"<h1>{escape(title)}</h1>"
        f'<p class="lead">{escape(span)}. Billed {usd(total)} in all; {usd(saved)} less than the '
        "same jobs sent row by row to the realtime API with no dedupe and no cache.</p>"
        f'<div class="charts">{"".join(_figure(c) for c in charts)}</div>'
        f"<h2>Runs</h2>{_runs_table(history)}"
        "</main></body></html>\n"
    )
