"""The `lowtide` command: run, demo, status, sql, emulator."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()
err_console = Console(stderr=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_JOB = REPO_ROOT / "data" / "jobs" / "support-intents.toml"


def _prefect_env() -> None:
    """Keep Prefect offline and inside the working directory unless the user chose otherwise."""
    os.environ.setdefault("PREFECT_HOME", str(Path(".lowtide/prefect").resolve()))
    # Prefect's SQLite cannot create the folder itself ("unable to open database file")
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    # The terminal gets lowtide's own one-line errors; full tracebacks still reach the Prefect
    # UI through its API log handler.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def _with_progress(call):  # noqa: ANN001, ANN202 - any flow call
    """Run a flow call with a live progress display; known errors become one clear line."""
    _prefect_env()
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from lowtide import progress as progress_channel
    from lowtide.backends.base import BackendError
    from lowtide.jobspec import JobFileError
    from lowtide.lease import RunBusyError
    from lowtide.pricing import PriceError
    from lowtide.store.state import StateLockedError
    from tasks.assemble import BudgetExceededError
    from tasks.load import InputError

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        handle = bar.add_task("starting Prefect", total=None)

        def show(stage: str, done: int, total: int, note: str) -> None:
            bar.update(
                handle, description=f"{stage} {note}".strip(), completed=done, total=total or None
            )

        progress_channel.set_reporter(show)
        try:
            return call()
        except (
            JobFileError,
            InputError,
            PriceError,
            BudgetExceededError,
            StateLockedError,
            BackendError,
            RunBusyError,
        ) as e:
            raise _fail(str(e)) from e
        finally:
            progress_channel.set_reporter(None)


def _run_job(
    job_file: Path,
    backend: str | None,
    db: Path | None,
    wait: bool,
    emulator_url: str | None = None,
) -> dict[str, Any]:
    from lowtide.jobspec import JobFileError, load_job

    try:  # a bad job file is reported at once, before Prefect starts
        load_job(job_file, backend)
    except JobFileError as e:
        raise _fail(str(e)) from e

    def call() -> dict[str, Any]:
        from flows.enrich import enrich

        return enrich(
            job_file=str(job_file),
            backend=backend,
            db=str(db) if db else None,
            wait=wait,
            emulator_url=emulator_url,
        )

    return _with_progress(call)


def _print_summary(s: dict[str, Any]) -> None:
    t = Table(title=f"run {s['run_id']} — {s['status']}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    m = s.get("metrics") or {}
    realtime = s.get("realtime_cost_usd") or 0.0
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
        ("realtime, no dedupe, no cache", f"${realtime:.4f}"),
        (
            "savings vs realtime",
            f"${realtime - cost:.4f}"
            + (f" ({(realtime - cost) / realtime:.0%})" if realtime else ""),
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


def _exit_for(summary: dict[str, Any], wait: bool = True) -> None:
    if summary.get("status") == "held":
        err_console.print(
            f"[bold yellow]held by the eval gate:[/] {summary.get('gate_note')}. The job view still "
            f"shows the last published run; `lowtide publish {summary['run_id']}` releases this one."
        )
        raise typer.Exit(3)
    done = summary.get("status") in ("completed", "cancelled")
    if not done and not (not wait and summary.get("status") == "submitted"):
        raise typer.Exit(1)


@app.command()
def run(
    job_file: Annotated[Path, typer.Argument(help="The job file (TOML).")],
    backend: Annotated[
        str | None,
        typer.Option(help="emulator | openai | anthropic | vllm (overrides the job file)."),
    ] = None,
    db: Annotated[
        Path | None,
        typer.Option(help="Published DuckDB file (default lowtide.duckdb, or LOWTIDE_DB)."),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait/--no-wait",
            help="Wait for batches to finish (default), or exit after submitting and let "
            "`lowtide collect` finish the run.",
        ),
    ] = True,
) -> None:
    """Run one job end to end; exits 0 when every row ended succeeded or failed with a reason
    (with --no-wait: when the batches were submitted)."""
    summary = _run_job(job_file, backend, db, wait)
    if summary.get("status") == "submitted":
        console.print(
            f"run {summary['run_id']}: {summary.get('requests_sent')} requests submitted; "
            "`lowtide collect` finishes it (schedule it every few minutes)."
        )
    else:
        _print_summary(summary)
    _exit_for(summary, wait)


@app.command()
def collect(
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Poll every in-flight run once, finish the batches that ended, and exit."""

    def call() -> list[dict[str, Any]]:
        from flows.collect import collect as collect_flow

        return collect_flow(db=str(db) if db else None)

    touched = _with_progress(call)
    if not touched:
        console.print("nothing in flight")
    for s in touched:
        if s.get("status") in ("completed", "cancelled", "held"):
            _print_summary(s)
        else:
            console.print(f"run {s['run_id']}: {s['status']}, still waiting on the provider")


@app.command()
def cancel(
    run_id: Annotated[str, typer.Argument(help="The run whose in-flight batches to cancel.")],
) -> None:
    """Cancel a run's in-flight batches; `lowtide collect` then records what finished."""
    import orjson

    from lowtide.backends import make_backend
    from lowtide.backends.base import BackendError
    from lowtide.settings import Settings
    from lowtide.store.state import Store

    settings = Settings()
    store = Store(settings.state, settings.lock_timeout_s)
    run = store.get_run(run_id)
    if run is None:
        raise _fail(f"no run {run_id!r} in {settings.state}")
    if run["status"] not in ("running", "submitted", "cancelling"):
        raise _fail(f"run {run_id} is {run['status']}; only a run in flight can be cancelled")
    # marked first, so nothing starts another round while the cancel calls go out
    store.update_run(run_id, status="cancelling")
    unsent = store.query(
        "SELECT batch_id FROM batches WHERE run_id = ? AND provider_batch_id IS NULL "
        "AND status IN ('pending', 'uploaded')",
        [run_id],
    )
    reason = orjson.dumps([{"code": "cancelled", "message": "cancelled before it was sent"}])
    for b in unsent["batch_id"]:
        store.update_batch(b, status="cancelled", errors=reason.decode())
    live = store.query(
        "SELECT batch_id, provider_batch_id FROM batches WHERE run_id = ? AND provider_batch_id "
        "IS NOT NULL AND status NOT IN ('completed', 'failed', 'expired', 'cancelled')",
        [run_id],
    )
    try:
        backend = make_backend(run["backend"], emulator_url=os.environ.get("LOWTIDE_EMULATOR_URL"))
        for b in live.iter_rows(named=True):
            backend.cancel(b["provider_batch_id"])
    except BackendError as e:
        raise _fail(f"{e} (the run is marked cancelling; run `lowtide cancel` again)") from e
    console.print(
        f"run {run_id}: cancel sent for {live.height} batch(es), {unsent.height} not yet sent "
        "dropped; finished work is kept. Run `lowtide collect` to record the outcome."
    )


@app.command()
def publish(
    run_id: Annotated[
        str, typer.Argument(help="The run to publish (e.g. one held by the eval gate).")
    ],
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Make a finished run the one the job view shows, and rebuild the published file."""
    from datetime import UTC, datetime

    from lowtide.settings import Settings
    from lowtide.store.publish import publish as publish_file
    from lowtide.store.state import Store

    settings = Settings().with_overrides(db=db)
    store = Store(settings.state, settings.lock_timeout_s)
    run = store.get_run(run_id)
    if run is None:
        raise _fail(f"no run {run_id!r} in {settings.state}")
    if run["status"] not in ("completed", "held", "cancelled"):
        raise _fail(f"run {run_id} is {run['status']}; only a finished run can be published")
    store.update_run(
        run_id,
        status="completed" if run["status"] == "held" else run["status"],
        published_at=datetime.now(UTC).replace(tzinfo=None),
    )
    path = publish_file(store, settings.db, store.job_views())
    console.print(f"run {run_id} published to {path}")


@app.command()
def export(
    run_id: Annotated[str, typer.Argument(help="The run to export.")],
    format: Annotated[str, typer.Option("--format", help="parquet | csv | jsonl")] = "parquet",
    out: Annotated[
        Path | None, typer.Option(help="Output file (default <run_id>.<format>).")
    ] = None,
) -> None:
    """Write a run's rows as the job view shows them (source columns and typed outputs)."""
    from lowtide.settings import Settings
    from lowtide.store.export import export_run

    if format not in ("parquet", "csv", "jsonl"):
        raise _fail(f"unknown format {format!r}; use parquet, csv or jsonl")
    settings = Settings()
    target = out or Path(f"{run_id}.{format}")
    try:
        rows = export_run(settings, run_id, target, format)
    except LookupError as e:
        raise _fail(str(e)) from e
    console.print(f"{rows} rows written to {target}")


@app.command()
def demo(
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Run the sample job on the built-in emulator (no keys, no GPU) and show a first query."""
    summary = _run_job(SAMPLE_JOB, "emulator", db, True)
    _print_summary(summary)
    view = summary["job"].replace("-", "_")
    console.print(f"\nResults are in {summary['db']}. A first query:")
    query = f"SELECT message_id, channel, intent, urgency, summary FROM {view} LIMIT 5"
    console.print(f'  [bold]lowtide sql "{query}"[/]')
    _sql(query, Path(summary["db"]))
    console.print(
        f'Every column: [bold]lowtide sql "SELECT * FROM {view} LIMIT 5"[/] '
        f"(or duckdb {summary['db']})"
    )
    _exit_for(summary)


def _sql(query: str, db: Path) -> None:
    import duckdb

    if not db.is_file():
        raise _fail(f"{db}: no published file yet; run a job first (lowtide demo)")
    con = duckdb.connect(str(db), read_only=True)
    try:
        rel = con.sql(query)
        if rel is None:
            console.print("ok")
            return
        cols = rel.columns
        rows = rel.limit(200).fetchall()
    except duckdb.Error as e:
        raise _fail(f"{db}: {e}") from e
    finally:
        con.close()
    t = Table(show_lines=False)
    for c in cols:
        t.add_column(c, no_wrap=True, overflow="ellipsis", max_width=32)
    for r in rows:
        t.add_row(*["" if v is None else " ".join(str(v).split())[:200] for v in r])
    console.print(t)
    if len(rows) == 200:
        console.print("(first 200 rows shown)")


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL to run against the published file.")],
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Run SQL against the published file (read-only) and print a table."""
    from lowtide.settings import Settings

    _sql(query, db or Settings().db)


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
)


@app.command()
def status(
    run_id: Annotated[str | None, typer.Argument(help="One run (default: all runs).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show runs (and a run's batches) from the state file."""
    import orjson

    from lowtide.settings import Settings
    from lowtide.store.state import Store

    settings = Settings()
    if not settings.state.is_file():
        if as_json:
            console.print_json("[]")
            return
        raise _fail(f"{settings.state}: no state file yet; run a job first")
    store = Store(settings.state, settings.lock_timeout_s)
    runs = store.list_runs(run_id)
    if run_id and runs.is_empty():
        raise _fail(f"no run {run_id!r} in {settings.state}")
    records = [{k: r.get(k) for k in STATUS_FIELDS} for r in runs.iter_rows(named=True)]
    batches = store.query(
        "SELECT run_id, batch_id, status, provider_batch_id, n_requests, request_counts FROM batches "
        + ("WHERE run_id = ? " if run_id else "")
        + "ORDER BY run_id, shard, attempt",
        [run_id] if run_id else [],
    )
    metrics = store.query(
        "SELECT run_id, name, value FROM metrics "
        + ("WHERE run_id = ? " if run_id else "")
        + "ORDER BY run_id, name",
        [run_id] if run_id else [],
    )
    for rec in records:
        rec["batches"] = [b for b in batches.iter_rows(named=True) if b["run_id"] == rec["run_id"]]
        rec["metrics"] = {
            m["name"]: m["value"]
            for m in metrics.iter_rows(named=True)
            if m["run_id"] == rec["run_id"]
        }
    if as_json:
        print(orjson.dumps(records, default=str, option=orjson.OPT_INDENT_2).decode())
        return
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
    if run_id:
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


@app.command()
def emulator(
    port: Annotated[int, typer.Option(help="Port for the OpenAI/Anthropic emulator.")] = 8765,
    faults: Annotated[str, typer.Option(help="Fault rules, see docs/emulator.md.")] = "",
    time_scale: Annotated[float, typer.Option(help="Simulated seconds per real second.")] = 60.0,
    engines: Annotated[int, typer.Option(help="Also start N emulated vLLM engines.")] = 0,
    seed: Annotated[int, typer.Option(help="Seed for shuffling, errors and broken answers.")] = 0,
    malformed_rate: Annotated[float, typer.Option(help="Share of broken answers.")] = 0.0,
    error_rate: Annotated[float, typer.Option(help="Share of per-request provider errors.")] = 0.01,
    model_version: Annotated[
        int, typer.Option(help="Model version (2 answers a few % differently).")
    ] = 1,
) -> None:
    """Start the local emulator in the foreground and print the variables to export."""
    from lowtide.emulator.main import serve

    if port == 0:  # any free port
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    pool = None
    if engines:
        from lowtide.emulator.vllm_pool import start_engines

        pool = start_engines(engines)
        console.print(f"{engines} emulated vLLM engine(s):")
        console.print(f"  export LOWTIDE_VLLM_URLS={','.join(pool.urls)}")
    try:
        serve(
            port=port,
            faults=faults,
            time_scale=time_scale,
            seed=seed,
            malformed_rate=malformed_rate,
            error_rate=error_rate,
            model_version=model_version,
        )
    finally:
        if pool is not None:
            pool.close()


def _register_plan() -> None:
    from lowtide.planner import plan_command

    app.command(
        "plan", help="Capacity plan for a vLLM pool: sequences that fit, engine settings, cost."
    )(plan_command)


_register_plan()

qa_app = typer.Typer(no_args_is_help=True, help="Human review of a run's QA sample.")
app.add_typer(qa_app, name="qa")


@qa_app.command("export")
def qa_export(
    run_id: Annotated[str, typer.Argument(help="The run whose QA sample to export.")],
    out: Annotated[Path, typer.Option(help="CSV file to write.")] = Path("qa-sample.csv"),
) -> None:
    """Write the run's QA sample as CSV with empty `verdict` and `correct_value` columns."""
    from lowtide.qa_review import export_sample
    from lowtide.settings import Settings
    from lowtide.store.state import Store

    settings = Settings()
    try:
        n = export_sample(Store(settings.state, settings.lock_timeout_s), run_id, out)
    except LookupError as e:
        raise _fail(str(e)) from e
    console.print(
        f"{n} sampled rows written to {out}. Fill `verdict` with correct or incorrect "
        "(and `correct_value` where wrong), then `lowtide qa import`."
    )


@qa_app.command("import")
def qa_import(
    file: Annotated[Path, typer.Argument(help="The reviewed CSV from `lowtide qa export`.")],
) -> None:
    """Record a reviewer's verdicts; prints the reviewed accuracy with a 95% interval."""
    from lowtide.qa_review import ReviewFileError, import_verdicts
    from lowtide.settings import Settings
    from lowtide.store.state import Store

    settings = Settings()
    try:
        summary = import_verdicts(Store(settings.state, settings.lock_timeout_s), file)
    except ReviewFileError as e:
        raise _fail(str(e)) from e
    for run_id, v in summary.items():
        console.print(
            f"run {run_id}: {v['qa_reviewed']:.0f} reviewed, accuracy {v['qa_reviewed_accuracy']:.1%} "
            f"(95% CI {v['qa_accuracy_ci_low']:.1%} to {v['qa_accuracy_ci_high']:.1%})"
        )


def main() -> None:
    """The console script: known operational errors become one line on stderr, exit code 2."""
    import duckdb

    from lowtide.lease import RunBusyError
    from lowtide.store.state import StateLockedError

    try:
        app()
    except (StateLockedError, RunBusyError) as e:
        err_console.print(f"[bold red]error:[/] {e}")
        raise SystemExit(2) from e
    except duckdb.Error as e:
        err_console.print(
            f"[bold red]error:[/] the state file refused an operation: {e}. If it persists, "
            "report it with the output of `lowtide status --json`."
        )
        raise SystemExit(2) from e


if __name__ == "__main__":
    main()
