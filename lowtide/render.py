"""What the CLI prints: run summaries, status tables, query results and one-line errors.

Rich wraps text at 80 columns when stdout is not a terminal, so error lines that carry paths are
printed with `soft_wrap` and never wrapped; provider and user text is escaped (Rich would read
`[cost]` as markup).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lowtide.errors import LowtideError

console = Console()
err_console = Console(stderr=True, soft_wrap=True)


def run_summary(s: dict[str, Any]) -> None:
    """A run's numbers as a table, and a note when every row came from the cache."""
    t = Table(title=f"run {s['run_id']} — {s['status']}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    m = s.get("metrics") or {}
    naive = s.get("naive_cost_usd") or 0.0
    cost = s.get("cost_usd") or 0.0
    rows = [
        ("job / backend", f"{s['job']} / {s['backend']} ({s['model']})"),
        ("rows", s.get("rows")),
        ("units (after chunking)", s.get("units")),
        ("unique requests (incl. eval set)", s.get("unique_requests")),
        ("answered by earlier runs (cache)", s.get("cache_hits")),
        ("requests sent", s.get("requests_sent")),
        ("succeeded", s.get("succeeded")),
        ("failed", s.get("failed")),
        (
            "tokens in / cached / out",
            f"{s.get('input_tokens', 0):,} / {s.get('cached_tokens', 0):,} / {s.get('output_tokens', 0):,}",
        ),
        ("cost (batch price)", f"${cost:.4f}"),
        ("realtime, no dedupe, no cache", f"${naive:.4f}"),
        (
            "savings vs realtime",
            f"${naive - cost:.4f}" + (f" ({(naive - cost) / naive:.0%})" if naive else ""),
        ),
        (
            "  of which dedupe / cache",
            f"${m.get('dedupe_savings_usd', 0.0):.4f} / ${m.get('cache_savings_usd', 0.0):.4f}",
        ),
        (
            "eval accuracy",
            "n/a"
            if s.get("eval_accuracy") is None
            else f"{s['eval_accuracy']:.1%} "
            + " ".join(
                f"{k}={v:.1%}" for k, v in (s.get("eval_by_field") or {}).items() if v is not None
            ),
        ),
    ]
    if s.get("failures_by_reason"):
        rows.append(
            (
                "failures by reason",
                ", ".join(f"{k}: {v}" for k, v in s["failures_by_reason"].items()),
            )
        )
    for k, v in rows:
        t.add_row(k, "" if v is None else str(v))
    console.print(t)
    if s.get("units") and s.get("row_units_cached") == s.get("units"):
        sent = s.get("requests_sent") or 0
        tail = (
            "nothing was sent."
            if not sent
            else f"only the eval set ({sent} requests) was asked afresh, to catch model drift."
        )
        console.print(f"[green]Every row was answered by an earlier run (cache): {tail}[/]")


def published_query(query: str, db: Path) -> None:
    """Run SQL on the published file and print at most 200 rows."""
    from lowtide.store.published import query_published

    cols, rows = query_published(db, query, 200)
    if not cols:
        console.print("ok")
        return
    t = Table(show_lines=False)
    for c in cols:
        t.add_column(c, no_wrap=True, overflow="ellipsis", max_width=32)
    for r in rows:
        t.add_row(*["" if v is None else " ".join(str(v).split())[:200] for v in r])
    console.print(t)
    if len(rows) == 200:
        console.print("(first 200 rows shown)")


def status_tables(records: list[dict[str, Any]], one_run: bool) -> None:
    """Runs as a table; for one run also its batches, gate note and review accuracy."""
    t = Table("run", "status", "backend", "rows", "ok", "failed", "sent", "cached", "cost $")
    for r in records:
        t.add_row(
            r["run_id"],
            r["status"],
            r["backend"],
            *(
                str(r.get(k) or 0)
                for k in ("rows", "succeeded", "failed", "requests_sent", "cache_hits")
            ),
            f"{r.get('cost_usd') or 0:.4f}",
        )
    console.print(t)
    if one_run:
        bt = Table("batch", "status", "provider id", "requests", "counts")
        for b in records[0]["batches"]:
            bt.add_row(
                b["batch_id"],
                b["status"],
                b["provider_batch_id"] or "",
                str(b["n_requests"]),
                b["request_counts"] or "",
            )
        console.print(bt)
        m = records[0]["metrics"]
        if records[0].get("gate_note"):
            console.print(f"held by the eval gate: {records[0]['gate_note']}")
        if "qa_reviewed_accuracy" in m:
            console.print(
                f"QA review: {m['qa_reviewed']:.0f} reviewed, accuracy "
                f"{m['qa_reviewed_accuracy']:.1%} (95% CI {m['qa_accuracy_ci_low']:.1%} to "
                f"{m['qa_accuracy_ci_high']:.1%})"
            )


def error(exc: BaseException) -> int:
    """Print a lowtide error (or each error of a group) as one line; returns the exit code."""
    if isinstance(exc, BaseExceptionGroup):
        err_console.print(f"[bold red]error:[/] {escape(exc.message)}")
        return max(error(inner) for inner in exc.exceptions)
    where = "".join(f" ({note})" for note in getattr(exc, "__notes__", []))
    err_console.print(f"[bold red]error:[/] {escape(str(exc))}{escape(where)}")
    return exc.exit_code if isinstance(exc, LowtideError) else 1
