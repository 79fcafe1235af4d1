"""`lowtide shards`: a run's requests as `vllm run-batch` shards for an Indexed Job, and their
outputs back into the run (the logic is `flows/shards.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from lowtide import render
from lowtide.cli_flows import prefect_env, with_progress

console = render.console

shards_app = typer.Typer(
    no_args_is_help=True,
    help="Shards of `vllm run-batch` for an Indexed Job: export a run's requests, import the "
    "outputs.",
)

RunArg = Annotated[str, typer.Argument(help="The run (backend vllm-run-batch).")]


def _settings() -> Any:
    from lowtide.settings import Settings

    prefect_env()  # flows/shards.py imports the stage modules, which import Prefect
    return Settings()


@shards_app.command("export")
def export(
    run_id: RunArg,
    dir: Annotated[
        str,
        typer.Option(
            "--dir", help="Where to write input-00000.jsonl, ...: a path or an fsspec URL."
        ),
    ],
    max_requests: Annotated[
        int | None, typer.Option(min=1, help="At most this many requests per shard.")
    ] = None,
    shards: Annotated[
        int | None,
        typer.Option(min=1, help="Exactly this many shards (default: one engine-hour each)."),
    ] = None,
    resend_missing: Annotated[
        bool,
        typer.Option(
            "--resend-missing",
            help="Also send again the requests of shards that left no output file at all.",
        ),
    ] = False,
) -> None:
    """Write the run's requests that still need an answer as run-batch input shards, one per
    Job completion index, recorded in the state file before they are written."""
    settings = _settings()
    from flows.shards import export_run

    done = export_run(
        settings,
        run_id,
        dir,
        max_requests=max_requests,
        shards=shards,
        resend_missing=resend_missing,
    )
    n = len(done["shards"])
    stopped = (
        f"; {done['stopped']} stopped shard(s) ended, their unanswered requests included"
        if done["stopped"]
        else ""
    )
    if not n:
        console.print(f"run {run_id}: nothing to export{stopped}", soft_wrap=True)
        return
    again = " (an export cut short, finished)" if done.get("resumed") else ""
    console.print(
        f"run {run_id}: {done['requests']} requests in {n} shard(s) written to "
        f"{escape(done['directory'])}{again}{stopped}. Run the Indexed Job with completions={n}, "
        f"then `lowtide shards import {run_id}`.",
        soft_wrap=True,
    )


@shards_app.command("import")
def import_(
    run_id: RunArg,
    dir: Annotated[
        str | None,
        typer.Option(
            "--dir", help="Check that the run exported shards here (default: every export)."
        ),
    ] = None,
    db: Annotated[Path | None, typer.Option(help="Published DuckDB file.")] = None,
) -> None:
    """Join whatever output shards exist into the run, exactly once; the run finishes and is
    published when every request has its answer."""
    settings = _settings()
    from flows.shards import shard_dirs, shard_run
    from lowtide.backends.run_batch_shards import shard_dir
    from lowtide.errors import RunOutcomeError, UserError
    from lowtide.vocabulary import RunStatus

    run = shard_run(settings, run_id)
    if not RunStatus(run["status"]).in_flight:
        console.print(f"run {run_id} is {run['status']}: nothing to import", soft_wrap=True)
        return
    dirs = shard_dirs(settings, run_id)
    if dir is not None and shard_dir(dir) not in dirs:
        where = ", ".join(dirs) or "none yet (`lowtide shards export` writes them)"
        raise UserError(f"run {run_id} has no shards in {dir}; its shard directories: {where}")

    def call() -> list[dict[str, Any]]:
        from flows.collect import collect as collect_flow

        return collect_flow(db=str(db) if db else None, run_id=run_id)

    ended_badly: RunOutcomeError | None = None
    try:
        touched = with_progress(call, "flows.collect")
    except RunOutcomeError as e:  # held, or every row failed: shown, then its line and code
        touched, ended_badly = [e.summary], e
    if not touched:
        console.print(f"run {run_id} is no longer in flight: nothing to import", soft_wrap=True)
        return
    summary = touched[0]
    if summary.get("driven_by"):
        console.print(f"run {run_id}: driven by {summary['driven_by']}, left to it")
        return
    counts = summary.get("shards") or {}
    console.print(
        f"run {run_id}: {counts.get('imported', 0)} answers imported, "
        f"{counts.get('already_imported', 0)} lines already imported (ignored); shards: "
        f"{counts.get('completed', 0)} completed, {counts.get('partial', 0)} partial, "
        f"{counts.get('missing', 0)} without output",
        soft_wrap=True,
    )
    if ended_badly is not None:
        render.run_summary(summary)
        raise ended_badly
    if RunStatus(summary["status"]).finished:
        render.run_summary(summary)
    else:
        console.print(
            f"run {run_id}: {summary['status']}; {summary.get('pending', '?')} requests pending. "
            "When the Job has ended, `lowtide shards export "
            f"{run_id} --dir NEW_DIR` sends what the shards left.",
            soft_wrap=True,
        )
