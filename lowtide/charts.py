"""Charts of a job's history: a `JobHistory` in, self-contained SVG out.

Four charts, each a matplotlib figure drawn without pyplot (no GUI backend, no global figure
state) and written as SVG with its text kept as text, so a page can inline it, a browser can
search it, and the numbers printed on the bars are the numbers in the state file:

- `cost`: billed cost per run next to the same tokens at the realtime list price;
- `eval`: eval-set accuracy per output field per run;
- `failures`: failed input rows per run, stacked by reason;
- `savings`: what dedupe and the cross-run cache saved per run, at the realtime list price.

Every value label uses the formats of the run table (`$0.0178`, `72.5%`, `4`), so a chart can be
checked against `lowtide status` by eye. Pure: nothing here reads a file or the environment.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import polars as pl
from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

from lowtide.store.history import JobHistory

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

# Okabe–Ito: distinguishable with the common colour-vision deficiencies
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#56B4E9", "#CC79A7", "#F0E442", "#000000")
_RC: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",  # text stays text: searchable, small, checkable
    "svg.hashsalt": "lowtide",  # stable element ids: the same history gives the same SVG
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
}
SIZE_IN = (7.5, 3.3)
LABEL_ALL_POINTS = 8
"""Up to this many runs every bar and point carries its value; beyond, only the latest run."""


@dataclass(frozen=True)
class Chart:
    """One chart: `key` (cost, eval, failures, savings), its title, and an `<svg>` element."""

    key: str
    title: str
    svg: str

    def data_uri(self) -> str:
        """The SVG as a `data:` URI, for an `<img>` or a markdown image."""
        return "data:image/svg+xml;base64," + base64.b64encode(self.svg.encode()).decode()


def usd(value: float) -> str:
    return f"${value:,.4f}"


def pct(value: float) -> str:
    return f"{value:.1%}"


def run_labels(runs: pl.DataFrame) -> list[str]:
    """One x-axis label per run: its start (UTC, to the minute) and the run id's random tail,
    which tells apart runs started in the same minute."""
    labels = []
    for run_id, started in zip(runs["run_id"], runs["started_at"], strict=True):
        when = started.strftime("%b %d %H:%M") if isinstance(started, datetime) else "?"
        labels.append(f"{when}\n…{str(run_id)[-4:]}")
    return labels


def history_charts(history: JobHistory) -> list[Chart]:
    """The four charts of the job's history, in reading order."""
    return [
        _chart("cost", "Cost per run: billed vs. realtime price", _draw_cost, history),
        _chart("eval", "Eval-set accuracy per field", _draw_eval, history),
        _chart("failures", "Failed rows per run, by reason", _draw_failures, history),
        _chart("savings", "Saved by dedupe and the cross-run cache", _draw_savings, history),
    ]


def _chart(key: str, title: str, draw: Callable[[Axes, JobHistory], None], h: JobHistory) -> Chart:
    with rc_context(_RC):
        fig = Figure(figsize=SIZE_IN, layout="constrained", facecolor="white")
        ax = fig.add_subplot()
        ax.set_title(title)
        draw(ax, h)
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None, "Title": title})
    text = out.getvalue()
    return Chart(key, title, text[text.index("<svg") :].strip())


def _x_axis(ax: Axes, labels: list[str]) -> list[int]:
    xs = list(range(len(labels)))
    ax.set_xticks(xs, labels, fontsize=7 if len(labels) > LABEL_ALL_POINTS else 8)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    return xs


def _labelled(n: int) -> list[bool]:
    """Which of n runs get value labels: all of a short history, else the latest only."""
    return [n <= LABEL_ALL_POINTS or i == n - 1 for i in range(n)]


def _bar_labels(ax: Axes, bars: object, values: list[float], fmt: Callable[[float], str]) -> None:
    show = _labelled(len(values))
    ax.bar_label(
        bars,  # type: ignore[arg-type]
        labels=[fmt(v) if s else "" for v, s in zip(values, show, strict=True)],
        fontsize=7,
        padding=2,
        rotation=90 if len(values) > 4 else 0,
    )


def _empty(ax: Axes, message: str) -> None:
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", color="#555555")
    ax.set_yticks([])


def _draw_cost(ax: Axes, h: JobHistory) -> None:
    xs = _x_axis(ax, run_labels(h.runs))
    width = 0.38
    series = (
        ("billed (batch price)", "cost_usd", PALETTE[0], -width / 2),
        ("same tokens at realtime price", "realtime_cost_usd", PALETTE[1], width / 2),
    )
    for label, column, color, shift in series:
        values = h.runs[column].to_list()
        bars = ax.bar([x + shift for x in xs], values, width, label=label, color=color)
        _bar_labels(ax, bars, values, usd)
    ax.yaxis.set_major_formatter(
        FuncFormatter(lambda v, _: f"${v:,.2f}" if v >= 0.1 else f"${v:.3f}")
    )
    ax.margins(y=0.3)
    ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=2)


def _draw_eval(ax: Axes, h: JobHistory) -> None:
    xs = _x_axis(ax, run_labels(h.runs))
    if not h.evals.height:
        _empty(ax, "no eval set was scored in these runs")
        return
    position = dict(zip(h.runs["run_id"], xs, strict=True))
    for i, field in enumerate(sorted(set(h.evals["field"]))):
        part = h.evals.filter((pl.col("field") == field) & pl.col("accuracy").is_not_null())
        px = [position[r] for r in part["run_id"]]
        py = part["accuracy"].to_list()
        color = PALETTE[i % len(PALETTE)]
        ax.plot(px, py, marker="o", label=field, color=color, linewidth=1.8, markersize=5)
        for x, y, show in zip(px, py, _labelled(len(py)), strict=True):
            if show:
                ax.annotate(
                    pct(y),
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 6),
                    ha="center",
                    fontsize=7,
                    color=color,
                )
    ax.set_ylim(0, 1.08)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.legend(loc="best", fontsize=8, frameon=False, ncols=4)


def _draw_failures(ax: Axes, h: JobHistory) -> None:
    xs = _x_axis(ax, run_labels(h.runs))
    if not h.failures.height:
        _empty(ax, "no failed rows in these runs")
        return
    run_ids = h.runs["run_id"].to_list()
    totals = h.failures.group_by("reason").agg(pl.col("rows").sum()).sort(["rows", "reason"])
    bottom = [0.0] * len(xs)
    bars = None
    for i, reason in enumerate(reversed(totals["reason"].to_list())):
        counts = dict(
            h.failures.filter(pl.col("reason") == reason).select("run_id", "rows").iter_rows()
        )
        heights = [float(counts.get(r, 0)) for r in run_ids]
        bars = ax.bar(xs, heights, 0.6, bottom=bottom, label=reason, color=PALETTE[(i + 3) % 8])
        bottom = [b + v for b, v in zip(bottom, heights, strict=True)]
    if bars is not None:
        _bar_labels(ax, bars, bottom, lambda v: f"{v:,.0f}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("rows")
    ax.margins(y=0.25)
    ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=3)


def _draw_savings(ax: Axes, h: JobHistory) -> None:
    xs = _x_axis(ax, run_labels(h.runs))
    dedupe = h.runs["dedupe_savings_usd"].to_list()
    cache = h.runs["cache_savings_usd"].to_list()
    ax.bar(xs, dedupe, 0.6, label="dedupe (identical units asked once)", color=PALETTE[2])
    bars = ax.bar(xs, cache, 0.6, bottom=dedupe, label="cross-run cache", color=PALETTE[4])
    _bar_labels(ax, bars, [d + c for d, c in zip(dedupe, cache, strict=True)], usd)
    ax.yaxis.set_major_formatter(
        FuncFormatter(lambda v, _: f"${v:,.2f}" if v >= 0.1 else f"${v:.3f}")
    )
    ax.margins(y=0.3)
    ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=2)
