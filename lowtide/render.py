"""What the CLI prints: run summaries, status tables, query results and one-line errors.

Rich wraps text at 80 columns when stdout is not a terminal, so error lines that carry paths are
printed with `soft_wrap` and never wrapped, and `error_line` joins a message's own line breaks
(a DuckDB or Polars error's context) into one line. Provider, user and query text is printed as
`Text`, never parsed: Rich would read `[cost]` as markup and `:smile:` as an emoji.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from lowtide.errors import LowtideError, worst_exit_code

console = Console()
err_console = Console(stderr=True, soft_wrap=True)


# `status --json` fields, a contract scripts rely on: extend, never rename
STATUS_FIELDS = (
    "run_id",
    "job",
    "backend",
    "model",
    "status",
    "rows",
    "succeeded",
    "failed",
    "unique_requests",
    "requests_sent",
    "cache_hits",
    "cost_usd",
    "estimate_usd",
    "eval_accuracy",
    "started_at",
    "finished_at",
    "published_at",
    "error",
    "gate_note",
    "unchanged_from",
    "carried_from",  # a changed night: the run whose units its unchanged rows kept, and how many
    "rows_carried",
    "route_id",  # a [route]'s step: its first step's run, its place, when it ends or switched
    "route_step",
    "step_ends_at",
    "switched_at",
)


def run_summary(s: dict[str, Any]) -> None:
    """A run's numbers as a table (with where cached answers came from), a note when every row
    came from the cache, and one when a real backend's run holds the emulator's answers."""
    t = Table(title=f"run {s['run_id']} — {s['status']}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    m = s.get("metrics") or {}
    naive = s.get("naive_cost_usd") or 0.0
    cost = s.get("cost_usd") or 0.0
    rows = [
        ("job / backend", f"{s['job']} / {s['backend']} ({s['model']})"),
        ("rows", s.get("rows")),
        *(
            [("  unchanged, units kept from last run", s["rows_carried"])]
            if s.get("rows_carried")
            else []
        ),
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
    if s.get("cached_from"):
        rows.insert(5, ("  cached answers came from", _by_engine(s["cached_from"])))
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
    if s.get("unchanged_from"):
        console.print(
            f"[green]Job and input unchanged since run {escape(s['unchanged_from'])}: "
            "nothing was read or sent; the view shows the same rows.[/]"
        )
    elif s.get("units") and s.get("row_units_cached") == s.get("units"):
        sent = s.get("requests_sent") or 0
        tail = (
            "nothing was sent."
            if not sent
            else f"only the eval set ({sent} requests) was asked afresh, to catch model drift."
        )
        console.print(f"[green]Every row was answered by an earlier run (cache): {tail}[/]")
    _emulator_note(s)


def _by_engine(counts: dict[str, int]) -> str:
    return ", ".join(f"{engine}: {n:,}" for engine, n in counts.items())


def _emulator_note(s: dict[str, Any]) -> None:
    """Say so when a real backend's run holds answers lowtide's emulator gave (a client pointed
    at the emulator, or an earlier such run's cache): they are test data, not a model's."""
    from lowtide.backends import EMULATOR_ENGINE, REGISTRY

    entry = REGISTRY.get(s.get("backend") or "")
    fake = sum((s.get(k) or {}).get(EMULATOR_ENGINE, 0) for k in ("cached_from", "answered_by"))
    if entry is not None and not entry.emulated and fake:
        console.print(
            f"[yellow]{fake:,} answers of this {entry.name} run were given by lowtide's emulator "
            "(test data, not a model's); keep emulator runs in their own state file "
            "(LOWTIDE_STATE).[/]"
        )


def published_query(query: str, db: Path) -> None:
    """Run SQL on the published file and print at most 200 rows."""
    from lowtide.store.published import query_published

    cols, rows = query_published(db, query, 200)
    if not cols:
        console.print("ok")
        return
    t = Table(show_lines=False)
    for c in cols:
        t.add_column(Text(c), no_wrap=True, overflow="ellipsis", max_width=32)
    for r in rows:  # Text: values are shown as stored, never read as markup or emoji codes
        t.add_row(*[Text("" if v is None else " ".join(str(v).split())[:200]) for v in r])
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
    _left_at_provider(records)
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
            console.print(f"held: {records[0]['gate_note']}")
        if "qa_reviewed_accuracy" in m:
            console.print(
                f"QA review: {m['qa_reviewed']:.0f} reviewed, accuracy "
                f"{m['qa_reviewed_accuracy']:.1%} (95% CI {m['qa_accuracy_ci_low']:.1%} to "
                f"{m['qa_accuracy_ci_high']:.1%})"
            )


def _left_at_provider(records: list[dict[str, Any]]) -> None:
    """One line per run that left files (or batches) at its provider: kept by the job, or a
    delete that failed."""
    for r in records:
        left = r.get("left_at_provider") or {}
        if left.get("count"):
            console.print(
                f"run {r['run_id']} left {left['count']} item(s), {left['bytes']:,} bytes at "
                f"the provider; `lowtide leftovers JOB_FILE` lists them",
                soft_wrap=True,
            )


def estimate(q: dict[str, Any]) -> None:
    """A quote (`tasks.estimate.estimate_job`): what would be sent, its cost on every backend
    whose price is known, next to the budget; the assumptions and unpriced backends as notes."""
    t = Table(title=f"estimate {q['job']} — {q['backend']} ({q['model']})", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    est, budget = q.get("estimate_usd"), q.get("budget_usd")
    for k, v in (
        ("rows", f"{q['rows']:,}"),
        ("units (after chunking)", f"{q['units']:,}"),
        ("unique requests (incl. eval set)", f"{q['unique_requests']:,}"),
        ("answered by earlier runs (cache)", f"{q['cache_hits']:,}"),
        ("in a live batch (attached)", f"{q['in_flight']:,}"),
        ("requests to send", f"{q['requests_to_send']:,}"),
        ("input tokens (est.)", f"{q['input_tokens']:,}"),
        (
            "output tokens (est.)",
            f"{q['output_tokens']:,} ({q['output_tokens_per_request']:.1f}/request, "
            f"{q['output_tokens_source']})",
        ),
        ("estimate", "no price" if est is None else f"${est:.4f}"),
        ("budget ([cost] budget_usd)", "none" if budget is None else f"${budget:g}"),
    ):
        t.add_row(escape(k), escape(v))
    console.print(t)
    b = Table("backend", "model", "batch $", "realtime $", title="on every priced backend")
    for name, cost in q["by_backend"].items():
        if isinstance(cost, dict):
            batch, realtime = f"{cost['batch_usd']:.4f}", f"{cost['realtime_usd']:.4f}"
            b.add_row(name, cost["model"], batch, realtime)
        else:
            b.add_row(name, "(GPU time)", f"{cost:.4f}", "")
    console.print(b)
    route = q.get("route")
    if route:
        r = Table("step", "engine", "model", "batch $", title=escape("the route ([route] engines)"))
        for i, step in enumerate(route["steps"]):
            usd = "no price" if step["usd"] is None else f"{step['usd']:.4f}"
            r.add_row(str(i), step["engine"], step["model"], usd)
        console.print(r)
        best, worst = route["best_usd"], route["worst_usd"]
        console.print(
            f"route: ${best:.4f} if the first engine answers every row, up to ${worst:.4f} "
            "if the dearest one does (answers paid twice while switching come on top)"
            if best is not None and worst is not None
            else "route: not every engine has a price",
            soft_wrap=True,
        )
    cache_line = prompt_cache_line(q.get("prompt_cache"))
    if cache_line:
        console.print(Text(cache_line), soft_wrap=True)
    for name, why in q.get("skipped", {}).items():
        console.print(f"not priced: {escape(name)}: {escape(why)}", soft_wrap=True)
    for note in q.get("assumptions", []):
        console.print(f"assumed: {escape(note)}", soft_wrap=True)
    if q.get("over_budget"):
        err_console.print(
            f"[bold yellow]over budget:[/] a run would be refused; raise {escape('[cost]')} "
            "budget_usd in the job file or run fewer rows"
        )


def prompt_cache_line(cache: dict[str, Any] | None) -> str | None:
    """One line on what the provider's prompt cache does with the job's stable prefix (a
    quote's `prompt_cache`), or None when the engine has none that prices tokens."""
    if cache is None:
        return None
    prefix, minimum = cache["prefix_tokens"], cache["min_tokens"]
    head = f"prompt cache: the stable prefix is {prefix:,} tokens"
    whose = f"{cache['provider']}'s minimum"
    if minimum is None:
        return (
            f"{head}; {whose} for {cache['model']} is not in lowtide's table: it may not be cached"
        )
    if not cache["cached"]:
        return f"{head}, below {whose} of {minimum:,} for {cache['model']}: it will not be cached"
    saved = cache["saved_usd"]
    what = (
        "no price to say what that saves"
        if saved is None
        else f"saving up to ${saved:.4f} on this job (the estimate counts no cache reads)"
    )
    return (
        f"{head}, enough for {whose} of {minimum:,} for {cache['model']}: each later request "
        f"reads {cache['cached_tokens_per_request']:,} of them from cache, {what}"
    )


def one_line(text: str) -> str:
    """`text` with its line breaks (and the indentation after them) joined by single spaces."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def error_line(message: str, label: str = "error:", style: str = "bold red") -> None:
    """`label message` as exactly one line on stderr, the message printed literally."""
    err_console.print(Text.assemble((label, style), " ", one_line(message)))


def error(exc: BaseException) -> int:
    """Print a lowtide error (or each error of a group) as one line; returns the exit code."""
    if isinstance(exc, BaseExceptionGroup):
        error_line(exc.message)
        return worst_exit_code([error(inner) for inner in exc.exceptions])
    where = "".join(f" ({note})" for note in getattr(exc, "__notes__", []))
    error_line(f"{exc}{where}")
    return exc.exit_code if isinstance(exc, LowtideError) else 1


def every_row_failed(s: dict[str, Any]) -> str:
    """The one line that says a run ended with no row answered, and the main reason why."""
    head = f"every row of run {s['run_id']} failed ({s.get('failed')} of {s.get('rows')})"
    top = s.get("main_failure")
    if not top:
        return head
    detail = one_line(str(top.get("detail") or ""))
    detail = detail if len(detail) <= 300 else detail[:297] + "..."
    reason = f"{top['reason']} ({top['rows']} rows)" + (f": {detail}" if detail else "")
    return f"{head}; main reason: {reason} (every row's reason is in the failures table)"
