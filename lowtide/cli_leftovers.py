"""`lowtide leftovers`: what a job's runs left at their provider, and deleting it (the logic is
`flows/leftovers.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from lowtide import render
from lowtide.backends import KNOWN
from lowtide.cli_flows import prefect_env

console = render.console


def leftovers(
    job_file: Annotated[Path, typer.Argument(help="The job file (TOML).")],
    backend: Annotated[
        str | None, typer.Option(help=f"{' | '.join(KNOWN)} (overrides the job file).")
    ] = None,
    delete: Annotated[
        bool,
        typer.Option("--delete", help="Delete what is left (never what a run still needs)."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List the files (and Anthropic batches) the job's runs left at their provider, found by
    lowtide's tags; with --delete, delete those no run still needs. Exits 1 when a delete
    failed (run it again)."""
    prefect_env()  # a key in a Secret block is read from the same Prefect home as `run`'s
    from lowtide.orchestration import without_prefect
    from lowtide.settings import Settings

    with without_prefect():  # the release stage's module: its functions, not its task
        from flows.leftovers import sweep

    found = sweep(Settings(), job_file, backend, delete)
    if as_json:
        import orjson

        print(orjson.dumps(found, option=orjson.OPT_INDENT_2).decode())
    else:
        _show(found, delete, job_file)
    if found["failed"]:
        first = next(i["error"] for i in found["items"] if i["error"])
        render.error_line(
            f"{found['failed']} delete(s) failed (first: {first}); run the command again"
        )
        raise typer.Exit(1)


def _show(found: dict[str, Any], delete: bool, job_file: Path) -> None:
    job, backend = found["job"], found["backend"]
    if not found["items"]:
        console.print(f"{job} on {backend}: nothing left at the provider", soft_wrap=True)
        return
    t = Table("provider id", "kind", "role", "batch", "bytes", "state")
    for i in found["items"]:
        state = i["state"]
        if i["deleted"]:
            state = "deleted"
        elif i["error"]:
            state = f"{state}, delete failed"
        t.add_row(
            escape(i["provider_id"]),
            i["kind"],
            i["role"],
            escape(i["batch_id"]),
            "" if i["bytes"] is None else f"{i['bytes']:,}",
            state,
        )
    console.print(t)
    deleted = f", {found['deleted']} deleted" if delete else ""
    hint = (
        f"; `lowtide leftovers {escape(str(job_file))} --delete` deletes what is left"
        if found["left"] and not delete
        else ""
    )
    console.print(
        f"{job} on {backend}: {found['count']} item(s), {found['bytes']:,} bytes at the "
        f"provider ({found['in_use']} in use, {found['kept']} kept, {found['left']} left"
        f"{deleted}){hint}",
        soft_wrap=True,
    )
