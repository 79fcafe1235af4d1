"""Who runs the stages: Prefect, or this process alone.

Every flow and stage is a Prefect flow or task, so a deployment, a test under Prefect's harness
or a CLI run against a configured server shows each run and its task runs in the UI. When the
CLI has no server to report to, starting Prefect's temporary one costs ~8 s of a core to record
runs that no UI shows (`lowtide status` and the state file hold every fact of a run), so the CLI
runs the same flows in-process instead (`in_process()`): each flow and task calls its function
directly, a task keeps its retries on transient provider errors, and each stage's duration goes
to `lowtide.stages` (and, with LOWTIDE_STAGE_TIMINGS, to a file: the benchmark's per-stage
seconds). Outside `in_process()` these are Prefect's own flows and tasks, unchanged.
"""

from __future__ import annotations

import inspect
import logging
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import orjson
from prefect import Flow, Task
from prefect.states import Failed
from prefect.utilities.math import clamped_poisson_interval

from lowtide.errors import TransientBackendError

_IN_PROCESS: ContextVar[bool] = ContextVar("lowtide_in_process", default=False)
_TIMINGS: ContextVar[Path | None] = ContextVar("lowtide_stage_timings", default=None)
_log = logging.getLogger("lowtide.stages")


@contextmanager
def in_process(timings: Path | None = None) -> Iterator[None]:
    """Run the flows and tasks called inside without Prefect; `timings` (a JSON-lines file)
    gets one line per stage call: the flow or task's name, its run name and seconds."""
    token = _IN_PROCESS.set(True)
    timings_token = _TIMINGS.set(timings)
    try:
        yield
    finally:
        _TIMINGS.reset(timings_token)
        _IN_PROCESS.reset(token)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition for tasks that talk to a provider: only transient errors."""
    try:
        state.result()
    except TransientBackendError:
        return True
    except Exception:  # noqa: BLE001 - any other failure is terminal for this task
        return False
    return False


class Stage(Task):
    """A Prefect task that, inside `in_process()`, is a plain call of its function, retried as
    Prefect would: up to `retries` times, when `retry_condition_fn` (if set) says so, after
    `retry_delay_seconds` with the same jitter. (`with_options`, `.submit` and `.map` give or
    use Prefect's own task: the flows here do not use them.)"""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _IN_PROCESS.get():
            return super().__call__(*args, **kwargs)
        run_name = _run_name(self.fn, self.task_run_name, args, kwargs) or self.name
        delays = _delays(self.retry_delay_seconds, self.retries or 0)
        with _timed("task", self.name, run_name):
            for attempt in range(len(delays) + 1):
                try:
                    return self.fn(*args, **kwargs)
                except Exception as err:
                    if attempt == len(delays) or not self._retries_after(err):
                        raise
                    wait = delays[attempt]
                    if self.retry_jitter_factor and wait > 0:
                        wait = clamped_poisson_interval(wait, self.retry_jitter_factor)
                    _log.warning("%s: %s; retrying in %.1f s", run_name, err, wait)
                    time.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _retries_after(self, err: Exception) -> bool:
        if self.retry_condition_fn is None:
            return True
        return bool(self.retry_condition_fn(self, None, Failed(data=err)))  # type: ignore[arg-type]


class Pipeline(Flow):
    """A Prefect flow that, inside `in_process()`, is a plain call of its function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _IN_PROCESS.get():
            return super().__call__(*args, **kwargs)
        run_name = self.flow_run_name if isinstance(self.flow_run_name, str) else None
        formatted = _run_name(self.fn, run_name, args, kwargs) or self.name
        with _timed("flow", self.name, formatted):
            return self.fn(*args, **kwargs)


def task(**options: Any) -> Callable[[Callable[..., Any]], Stage]:
    """`prefect.task` with the same options, giving a `Stage`."""
    return lambda fn: Stage(fn, **options)


def flow(**options: Any) -> Callable[[Callable[..., Any]], Pipeline]:
    """`prefect.flow` with the same options, giving a `Pipeline`."""
    return lambda fn: Pipeline(fn, **options)


def _run_name(
    fn: Callable[..., Any], template: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    if not isinstance(template, str):
        return None
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        return template.format(**bound.arguments)
    except (TypeError, KeyError, IndexError, ValueError):
        return template


def _delays(setting: object, retries: int) -> list[float]:
    """Prefect's retry_delay_seconds (a number or a list, the last repeated) as one delay per
    retry."""
    if retries <= 0:
        return []
    if isinstance(setting, (int, float)):
        return [float(setting)] * retries
    listed = [float(d) for d in setting] if isinstance(setting, list) and setting else [0.0]
    return [listed[min(i, len(listed) - 1)] for i in range(retries)]


@contextmanager
def _timed(kind: str, name: str, run_name: str) -> Iterator[None]:
    started, cpu_started = time.perf_counter(), time.process_time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    try:
        yield
    finally:
        seconds = time.perf_counter() - started
        _log.info("%s %s took %.2f s", kind, run_name, seconds)
        path = _TIMINGS.get()
        if path is not None:
            # the process's CPU across all its threads: a stage's own while stages run in turn;
            # of it, the kernel's, and the pages it touched for the first time (on a virtual
            # machine a fault costs microseconds: a 1M night's kernel CPU is mostly these)
            now = resource.getrusage(resource.RUSAGE_SELF)
            line = {
                "kind": kind,
                "name": name,
                "run_name": run_name,
                "seconds": seconds,
                "cpu_s": time.process_time() - cpu_started,
                "sys_s": now.ru_stime - usage.ru_stime,
                "page_faults": now.ru_minflt - usage.ru_minflt,
                # the process's high-water mark so far: the first stage that shows the run's
                # final figure is where its peak was
                "peak_rss_mb": round(now.ru_maxrss / 1024, 1),
            }
            try:
                with path.open("ab") as out:
                    out.write(orjson.dumps(line) + b"\n")
            except OSError as err:  # a figure for the curious never fails the stage it timed
                _log.warning("stage timings not written to %s: %s", path, err)
