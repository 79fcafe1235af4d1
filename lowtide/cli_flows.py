"""Running a flow from the CLI: Prefect's environment, its temporary server (started tied to
this process, with the flow's imports and other warm-ups done while it boots) or no server at
all (the flow in-process, when none is configured), a live progress display; and the run
command's way around all of it on an unchanged night."""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowtide import render
from lowtide.backends import backend_entry
from lowtide.interrupts import raise_from_signal

if TYPE_CHECKING:
    from lowtide.settings import Settings

PREFECT_HOME = Path(".lowtide/prefect")  # where Prefect keeps its files unless PREFECT_HOME says


def prefect_env() -> None:
    from lowtide.settings import prefect_defaults

    prefect_defaults(PREFECT_HOME)


def through_prefect(settings: Settings) -> bool:
    """Whether a CLI flow call goes through a Prefect server: a configured one, or the
    temporary one when LOWTIDE_PREFECT_SERVER=temporary. Otherwise no UI would ever show the
    run, and the flow runs in this process without Prefect (lowtide/orchestration.py)."""
    from lowtide.settings import prefect_server_configured

    return prefect_server_configured(PREFECT_HOME) or settings.prefect_server == "temporary"


def with_progress(call, flow_module: str, warm_ups=()):  # noqa: ANN001, ANN202 - any flow call
    """Run a flow call with a live progress display (errors are reported by `main`). Through
    Prefect, the call's `flow_module` is imported while Prefect's temporary server starts, then
    `warm_ups` for as long as it is still starting; in-process, nothing waits for a server."""
    prefect_env()
    from lowtide.settings import Settings

    settings = Settings()
    reported = through_prefect(settings)
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from lowtide import progress as progress_channel

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=render.err_console,
        transient=True,
        disable=not render.err_console.is_terminal,  # in a pipe it would only add an empty line
    ) as bar:
        handle = bar.add_task("starting Prefect" if reported else "starting", total=None)

        def show(stage: str, done: int, total: int, note: str) -> None:
            bar.update(
                handle, description=f"{stage} {note}".strip(), completed=done, total=total or None
            )

        progress_channel.set_reporter(show)
        try:
            if not reported:
                from lowtide.orchestration import in_process, without_prefect

                # the flow's module, imported by `call`, makes plain stages
                with (
                    without_prefect(),
                    in_process(settings.stage_timings),
                    _terminate_as_interrupt(),
                ):
                    return call()
            from lowtide.prefect_server import start_tied_server

            # a SIGKILLed run must not leave Prefect's server behind
            start_tied_server(lambda: importlib.import_module(flow_module), warm_ups)
            return call()
        finally:
            progress_channel.set_reporter(None)


class Terminated(KeyboardInterrupt):
    """SIGTERM while a flow runs in-process: unwound like Ctrl-C, then the process ends by the
    signal."""

    def end_process(self) -> None:
        """Die of SIGTERM (a service manager counts that as a clean stop, exit 130 as a
        failure); the run's `finally` blocks have run by now."""
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM)  # only if the signal did not end us


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (a service manager stopping the CLI) unwinds like Ctrl-C, so the run's lease,
    emulator and files are closed on the way out, as Prefect's flow engine does for its runs;
    the process still ends by the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise_from_signal(Terminated())  # noted: a DuckDB query it stops would lose it

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_job(
    job_file: Path,
    backend: str | None,
    db: Path | None,
    wait: bool,
    emulator_url: str | None = None,
) -> dict[str, Any]:
    from lowtide.jobspec import load_job

    job = load_job(job_file, backend)  # a bad job file is reported at once, before Prefect

    from lowtide.settings import Settings, prefect_server_configured

    if not prefect_server_configured(PREFECT_HOME):
        # no UI would show the run, so an unchanged night is answered from the state file
        # without starting Prefect's temporary server (~10 s); with a server, the flow checks
        from lowtide.nightly import unchanged_summary

        summary = unchanged_summary(Settings().with_overrides(db=db), job)
        if summary is not None:
            return summary

    def call() -> dict[str, Any]:
        from flows.enrich import enrich

        # what is alive now (Prefect, the SDKs, polars: ~155,000 objects) lives as long as the
        # process: set apart, a full collection no longer walks it each time (76 ms a walk;
        # gc was ~0.4 s of a 1M night's CPU)
        gc.freeze()
        return enrich(
            job_file=str(job_file),
            backend=backend,
            db=str(db) if db else None,
            wait=wait,
            emulator_url=emulator_url,
        )

    return with_progress(call, "flows.enrich", _run_warm_ups(job, wait))


def _run_warm_ups(job: Any, wait: bool) -> list[Callable[[], object]]:
    """What a run imports later, done while Prefect's server boots: its backend's SDK, the
    tokenizer (long texts are counted), and the report's charts (drawn when a run finishes)."""
    from lowtide.tokens import get_encoding

    ups = [backend_entry(job.model.backend).capabilities, lambda: get_encoding(job.chunk.encoding)]
    return [*ups, lambda: importlib.import_module("lowtide.charts")] if wait else ups
