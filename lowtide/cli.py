"""The `lowtide` command: run, demo, status, sql, emulator."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.markup import escape
from typer.core import TyperGroup

from lowtide import render
from lowtide.backends import KNOWN, backend_entry
from lowtide.cli_flows import Terminated, prefect_env, run_job, with_progress
from lowtide.cli_leftovers import leftovers
from lowtide.cli_shards import shards_app
from lowtide.errors import CollectError, LowtideError, RunOutcomeError
from lowtide.interrupts import forget_signal, interrupt_for, is_interrupt

console = render.console
err_console = render.err_console


class _OneLineErrors(TyperGroup):
    """Every command's lowtide errors become one line on stderr and the error's exit code
    (`lowtide.errors`); anything else is a bug and keeps its traceback."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        from typer._click.exceptions import UsageError

        try:
            return super().invoke(ctx)
        except LowtideError as e:
            raise typer.Exit(render.error(e)) from e
        except KeyboardInterrupt as e:  # Ctrl-C: one line, and the way back in (not Abort)
            _interrupted(e)
        except UsageError as e:  # a subcommand's bad flag: one line too, not a box
            path = e.ctx.command_path if e.ctx is not None else "lowtide"
            hint = f" (see {path} --help)"
            render.error_line(f"{e.format_message()}{hint}")
            raise typer.Exit(2) from e
        except Exception as e:  # a DuckDB query a signal stopped says so; anything else is a bug
            if not is_interrupt(e):
                raise
            _interrupted(interrupt_for(e))


def _interrupted(e: BaseException) -> NoReturn:
    forget_signal()  # dealt with here: a later Ctrl-C in this process is its own
    render.error_line(
        "interrupted. A run is resumable: the same command continues it and sends "
        "nothing a provider already accepted (`lowtide status` shows where it stands).",
        label="stopped:",
    )
    if isinstance(e, Terminated):
        e.end_process()  # ended by SIGTERM, as a service manager expects
    raise typer.Exit(130) from None


app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__, cls=_OneLineErrors)

# the arguments `run` and `estimate` share; backend names come from the registry
JobFileArg = Annotated[Path, typer.Argument(help="The job file (TOML).")]
BackendOpt = Annotated[
    str | None, typer.Option(help=f"{' | '.join(KNOWN)} (overrides the job file).")
]

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_JOB = REPO_ROOT / "data" / "jobs" / "support-intents.toml"


def _fail(message: str, code: int = 2) -> typer.Exit:
    render.error_line(message)
    return typer.Exit(code)


def _summary_of(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The run's summary, also when its flow failed for the run's outcome (held, every row
    failed: `RunOutcomeError`, which carries it); `_exit_for` then says why and exits."""
    try:
        return call()
    except RunOutcomeError as e:
        return e.summary


def _exit_for(summary: dict[str, Any], wait: bool = True) -> None:
    """3 when a gate held the run; 1 when it did not complete, or every row failed (the main
    reason as one line); else 0. README's exit-code table is the contract."""
    if summary.get("status") == "held":
        render.error_line(
            f"{summary.get('gate_note')}. The job view still shows the last published run; "
            f"`lowtide publish {summary['run_id']}` releases this one.",
            label="held:",
            style="bold yellow",
        )
        raise typer.Exit(3)
    every_row_failed = summary.get("rows") and not summary.get("succeeded")
    if summary.get("status") in ("completed", "failed") and every_row_failed:
        render.error_line(render.every_row_failed(summary))
        raise typer.Exit(1)
    done = summary.get("status") in ("completed", "cancelled")
    if not done and not (not wait and summary.get("status") == "submitted"):
        raise typer.Exit(1)


@app.command()
def run(
    job_file: JobFileArg,
    backend: BackendOpt = None,
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
    """Run one job end to end; exits 0 when it was published (with --no-wait: when the
    batches were submitted), 1 failed, 2 bad job or configuration, 3 held, 75 retry later."""
    summary = _summary_of(lambda: run_job(job_file, backend, db, wait))
    shard_files = backend_entry(summary["backend"]).shard_files
    if summary.get("status") == "submitted" and shard_files:
        console.print(
            f"run {summary['run_id']}: planned as `vllm run-batch` shards; "
            f"`lowtide shards export {summary['run_id']} --dir DIR` writes them for the Job, "
            "`lowtide shards import` (or `collect`) takes the answers back.",
            soft_wrap=True,
        )
    elif summary.get("status") == "submitted":
        console.print(
            f"run {summary['run_id']}: {summary.get('requests_sent')} requests submitted; "
            "`lowtide collect` finishes it (schedule it every few minutes)."
        )
    else:
        render.run_summary(summary)
    _exit_for(summary, wait and not shard_files)


@app.command()
def collect(
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Poll every in-flight run once, finish the batches that ended, and exit."""
    from lowtide.settings import Settings

    settings = Settings()
    if not _anything_in_flight(settings):
        # the common case of a schedule every few minutes: answer from the state file alone,
        # without starting Prefect (its temporary server alone takes ~10 s)
        console.print("nothing in flight")
        return

    def call() -> list[dict[str, Any]]:
        from flows.collect import collect as collect_flow

        return collect_flow(db=str(db) if db else None)

    try:
        touched = with_progress(call, "flows.collect")
    except CollectError as e:  # the runs it did collect are shown before the reasons
        _show_collected(e.summaries)
        raise
    except RunOutcomeError as e:
        _show_collected([e.summary])
        raise
    if not touched:
        console.print("nothing in flight")
    _show_collected(touched)


def _show_collected(touched: list[dict[str, Any]]) -> None:
    for s in touched:
        if s.get("status") in ("completed", "cancelled", "held", "failed"):
            render.run_summary(s)
        elif s.get("driven_by"):
            console.print(
                f"run {s['run_id']}: driven by {s['driven_by']}, left to it", soft_wrap=True
            )
        else:
            console.print(
                f"run {s['run_id']}: {s['status']}, still waiting on the provider", soft_wrap=True
            )


def _anything_in_flight(settings: Any) -> bool:
    from lowtide.store.in_flight import any_in_flight

    return any_in_flight(settings.state, settings.lock_timeout_s)


@app.command()
def cancel(
    run_id: Annotated[str, typer.Argument(help="The run whose in-flight batches to cancel.")],
) -> None:
    """Cancel a run's in-flight batches; `lowtide collect` then records what finished."""
    prefect_env()  # a key in a Secret block is read from the same Prefect home as `run`'s
    from flows.operations import cancel_run
    from lowtide.settings import Settings

    done = cancel_run(Settings(), run_id)
    console.print(
        f"run {run_id}: cancel sent for {done['cancelled_in_flight']} batch(es), "
        f"{done['dropped_unsent']} not yet sent dropped; finished work is kept. "
        "Run `lowtide collect` to record the outcome."
    )


@app.command()
def publish(
    run_id: Annotated[
        str, typer.Argument(help="The run to publish (e.g. one held by the eval gate).")
    ],
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Make a finished run the one the job view shows, and rebuild the published file."""
    from flows.operations import publish_run
    from lowtide.settings import Settings

    done = publish_run(Settings().with_overrides(db=db), run_id)
    console.print(f"run {run_id} published to {escape(done['db'])}", soft_wrap=True)


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
    from lowtide.store import EXPORT_FORMATS, Store

    if format not in EXPORT_FORMATS:
        raise _fail(f"unknown format {format!r}; use {', '.join(EXPORT_FORMATS)}")
    settings = Settings()
    target = out or Path(f"{run_id}.{format}")
    rows = Store(settings.state, settings.lock_timeout_s).export_run(run_id, target, format)
    console.print(f"{rows} rows written to {escape(str(target))}", soft_wrap=True)


@app.command()
def demo(
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Run the sample job on the built-in emulator (no keys, no GPU) and show a first query."""
    summary = _summary_of(lambda: run_job(SAMPLE_JOB, "emulator", db, True))
    render.run_summary(summary)
    view = summary["job"].replace("-", "_")
    console.print(f"\nResults are in {escape(summary['db'])}. A first query:", soft_wrap=True)
    from lowtide.store.published import first_query

    query = first_query(view, ["message_id", "channel", "intent", "urgency", "summary"])
    console.print(f'  [bold]lowtide sql "{query}"[/]')
    render.published_query(query, Path(summary["db"]))
    console.print(
        f'Every column: [bold]lowtide sql "{first_query(view, ["*"])}"[/] '
        f"(or duckdb {summary['db']})"
    )
    _exit_for(summary)


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="SQL to run against the published file.")],
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Run SQL against the published file (read-only) and print a table."""
    from lowtide.settings import Settings

    render.published_query(query, db or Settings().db)


@app.command()
def status(
    run_id: Annotated[str | None, typer.Argument(help="One run (default: all runs).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show runs (and a run's batches) from the state file."""
    import orjson

    from lowtide.settings import Settings
    from lowtide.store import Store

    settings = Settings()
    if not settings.state.is_file():
        if as_json:
            console.print_json("[]")
            return
        raise _fail(f"{settings.state}: no state file yet; run a job first")
    store = Store(settings.state, settings.lock_timeout_s)
    if run_id:
        store.require_run(run_id)
    records = store.status_records(run_id, render.STATUS_FIELDS)
    if as_json:
        print(orjson.dumps(records, default=str, option=orjson.OPT_INDENT_2).decode())
        return
    render.status_tables(records, one_run=bool(run_id))


@app.command()
def report(
    job: Annotated[str, typer.Argument(help="The job's name (or its job file).")],
    out: Annotated[Path, typer.Option(help="HTML file to write.")] = Path("report.html"),
    db: Annotated[
        Path | None, typer.Option(help="Read a published DuckDB file instead of the state file.")
    ] = None,
    runs: Annotated[int, typer.Option(min=1, help="How many of the latest finished runs.")] = 20,
) -> None:
    """Chart a job's history (cost and realtime price, eval accuracy, failures, savings per run)
    as one self-contained HTML page that opens offline."""
    from lowtide.report_html import report_html
    from lowtide.settings import Settings
    from lowtide.store import Store
    from lowtide.store.history import published_history

    if job.endswith(".toml"):
        from lowtide.jobspec import load_job

        job = load_job(Path(job)).name
    settings = Settings()
    if db is not None:
        history = published_history(db, job, runs)
    elif not settings.state.is_file():
        raise _fail(f"{settings.state}: no state file yet; run a job first")
    else:
        history = Store(settings.state, settings.lock_timeout_s).job_history(job, runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report_html(history), encoding="utf-8")
    console.print(
        f"{history.runs.height} run(s) of {job} charted in {escape(str(out))}", soft_wrap=True
    )


@app.command()
def estimate(
    job_file: JobFileArg,
    backend: BackendOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Quote a run before paying: rows, requests, cache hits, tokens and the cost on every
    priced backend, next to the budget. Sends nothing and creates no run or state file."""
    import orjson

    from lowtide.jobspec import load_job
    from lowtide.settings import Settings

    job = load_job(job_file, backend)
    prefect_env()  # the stage modules import Prefect (for their @task); keep it offline
    from tasks.estimate import estimate_job

    quote = estimate_job(job, Settings(), backend)
    if as_json:
        print(orjson.dumps(quote, option=orjson.OPT_INDENT_2).decode())
        return
    render.estimate(quote)


def _register_plan() -> None:
    from lowtide.planner import plan_command

    app.command(
        "plan", help="Capacity plan for a vLLM pool: sequences that fit, engine settings, cost."
    )(plan_command)


_register_plan()


def _register_emulator() -> None:
    from lowtide.cli_emulator import emulator

    app.command(
        help="Start the local emulator in the foreground and print the variables to export."
    )(emulator)


_register_emulator()

app.add_typer(shards_app, name="shards")
app.command("leftovers")(leftovers)

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
    from lowtide.store import Store

    settings = Settings()
    n = export_sample(Store(settings.state, settings.lock_timeout_s), run_id, out)
    console.print(
        f"{n} sampled rows written to {out}. Fill `verdict` with correct or incorrect "
        "(and `correct_value` where wrong), then `lowtide qa import`."
    )


@qa_app.command("import")
def qa_import(
    file: Annotated[Path, typer.Argument(help="The reviewed CSV from `lowtide qa export`.")],
) -> None:
    """Record a reviewer's verdicts; prints the reviewed accuracy with a 95% interval."""
    from lowtide.qa_review import import_verdicts
    from lowtide.settings import Settings
    from lowtide.store import Store

    settings = Settings()
    summary = import_verdicts(Store(settings.state, settings.lock_timeout_s), file)
    for run_id, v in summary.items():
        console.print(
            f"run {run_id}: {v['qa_reviewed']:.0f} reviewed, accuracy {v['qa_reviewed_accuracy']:.1%} "
            f"(95% CI {v['qa_accuracy_ci_low']:.1%} to {v['qa_accuracy_ci_high']:.1%})"
        )


def main() -> None:
    """The console script. Lowtide errors are reported by the command group; the published file
    and export targets turn their DuckDB errors into lowtide errors, so one reaching here is the
    state file refusing something unexpected."""
    import duckdb

    try:
        app()
    except duckdb.Error as e:
        render.error_line(
            f"the state file ({_state_path()}) refused an operation: {e}. If it persists, "
            "report it with the output of `lowtide status --json`."
        )
        raise SystemExit(2) from e


def _state_path() -> str:
    from lowtide.errors import LowtideError
    from lowtide.settings import Settings

    try:
        return str(Settings().state)
    except LowtideError:
        return "LOWTIDE_STATE"


if __name__ == "__main__":
    main()
