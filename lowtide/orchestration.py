"""Who runs the stages: Prefect, or this process alone.

Every flow and stage is a Prefect flow or task, so a deployment, a test under Prefect's harness
or a CLI run against a configured server shows each run and its task runs in the UI. When the
CLI has no server to report to, starting Prefect's temporary one costs ~8 s of a core to record
runs that no UI shows (`lowtide status` and the state file hold every fact of a run), so the CLI
runs the same flows in-process instead (`in_process()`): each flow and task calls its function
directly, a task keeps its retries on transient provider errors, and each stage's duration goes
to `lowtide.stages` (and, with LOWTIDE_STAGE_TIMINGS, to a file: the benchmark's per-stage
seconds). Outside `in_process()` these are Prefect's own flows and tasks, unchanged.

Importing Prefect costs ~0.8 s of CPU that such a run never uses. So the CLI's in-process path
runs the flow inside `without_prefect()`, and the flows and tasks its import makes are
plain callables (`PlainStage`, `PlainPipeline`) that build Prefect's own task or flow only when
called outside `in_process()`. Made any other way (a deployment's entrypoint, a test, a worker),
they are Prefect's own from the start (`lowtide.prefect_stages`).
"""

from __future__ import annotations

import functools
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

from lowtide.errors import TransientBackendError

_IN_PROCESS: ContextVar[bool] = ContextVar("lowtide_in_process", default=False)
_TIMINGS: ContextVar[Path | None] = ContextVar("lowtide_stage_timings", default=None)
_log = logging.getLogger("lowtide.stages")
_PLAIN: ContextVar[bool] = ContextVar("lowtide_plain_stages", default=False)
"""Set inside `without_prefect()`: flows and tasks made there are plain callables."""


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


RETRY_AFTER_MAX_S = 600.0
"""The longest a provider's `retry-after` holds a task before its retry (longer hints are
cut to this: the run's lease and progress must not go quiet for hours)."""


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition for tasks that talk to a provider: only transient errors, and
    not before the provider's `retry-after` (waited here, so Prefect's runs and the plain ones
    honour it alike; the task's own retry delay follows)."""
    try:
        state.result()
    except TransientBackendError as e:
        if e.retry_after_s:
            time.sleep(min(e.retry_after_s, RETRY_AFTER_MAX_S))
        return True
    except Exception:  # noqa: BLE001 - any other failure is terminal for this task
        return False
    return False


@contextmanager
def without_prefect() -> Iterator[None]:
    """Flows and tasks made inside (their modules first imported inside) are plain callables,
    so running them in-process never imports Prefect. The CLI runs a flow in-process inside it;
    a module imported once stays as it was made."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def in_process_now() -> bool:
    """Whether flows and tasks called now are plain calls (inside `in_process()`)."""
    return _IN_PROCESS.get()


def call_task(stage: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A task's function called directly, retried as Prefect would: up to `retries` times,
    when `retry_condition_fn` (if set) says so, after `retry_delay_seconds` with the same
    jitter. `stage` is a `PlainStage` or Prefect's own task (the attributes are the same)."""
    run_name = _run_name(stage.fn, stage.task_run_name, args, kwargs) or stage.name
    delays = _delays(stage.retry_delay_seconds, stage.retries or 0)
    with _timed("task", stage.name, run_name):
        for attempt in range(len(delays) + 1):
            try:
                return stage.fn(*args, **kwargs)
            except Exception as err:
                if attempt == len(delays) or not _retries_after(stage, err):
                    raise
                wait = delays[attempt]
                if stage.retry_jitter_factor and wait > 0:
                    from prefect.utilities.math import clamped_poisson_interval

                    wait = clamped_poisson_interval(wait, stage.retry_jitter_factor)
                _log.warning("%s: %s; retrying in %.1f s", run_name, err, wait)
                time.sleep(wait)
    raise AssertionError("unreachable: the last attempt returns or raises")


def _retries_after(stage: Any, err: Exception) -> bool:
    if stage.retry_condition_fn is None:
        return True
    # the condition reads a Prefect state: Prefect is imported for it only when a task failed
    from prefect.states import Failed

    return bool(stage.retry_condition_fn(stage, None, Failed(data=err)))


def call_flow(pipeline: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A flow's function called directly, timed under its run name."""
    template = pipeline.flow_run_name if isinstance(pipeline.flow_run_name, str) else None
    formatted = _run_name(pipeline.fn, template, args, kwargs) or pipeline.name
    with _timed("flow", pipeline.name, formatted):
        return pipeline.fn(*args, **kwargs)


class _Plain:
    """A flow or task made inside `without_prefect()`: inside `in_process()` a plain call of
    its function (`_call_plain`); elsewhere Prefect's own (`prefect`, built at its first such
    call), which also answers for any public attribute this object does not have."""

    _KIND = ""
    """Its Prefect class, in `lowtide.prefect_stages`."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        self.fn = fn
        self.options = options
        self.name: str = options.get("name") or fn.__name__
        self._prefect: Any = None
        functools.update_wrapper(self, fn)

    @property
    def prefect(self) -> Any:
        """Prefect's own task or flow for the same function and options."""
        if self._prefect is None:
            from lowtide import prefect_stages

            self._prefect = getattr(prefect_stages, self._KIND)(self.fn, **self.options)
        return self._prefect

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _IN_PROCESS.get():
            return self._call_plain(args, kwargs)
        return self.prefect(*args, **kwargs)

    def _call_plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not Prefect's to answer (and `_prefect` itself, unset)
            raise AttributeError(name)
        return getattr(self.prefect, name)


class PlainStage(_Plain):
    """A task made inside `without_prefect()` (`_Plain`), its retries as Prefect's task has
    them."""

    _KIND = "Stage"

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        super().__init__(fn, options)
        self.task_run_name = options.get("task_run_name")
        self.retries: int = options.get("retries") or 0
        self.retry_delay_seconds = options.get("retry_delay_seconds", 0)
        self.retry_jitter_factor = options.get("retry_jitter_factor")
        self.retry_condition_fn = options.get("retry_condition_fn")

    def _call_plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return call_task(self, args, kwargs)


class PlainPipeline(_Plain):
    """A flow made inside `without_prefect()` (`_Plain`)."""

    _KIND = "Pipeline"

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        super().__init__(fn, options)
        self.flow_run_name = options.get("flow_run_name")

    def _call_plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return call_flow(self, args, kwargs)


def task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`prefect.task` with the same options: Prefect's own task that runs in-process as a plain
    call (`lowtide.prefect_stages.Stage`), or inside `without_prefect()` a `PlainStage`."""
    if _PLAIN.get():
        return lambda fn: PlainStage(fn, options)
    from lowtide.prefect_stages import Stage

    return lambda fn: Stage(fn, **options)


def flow(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`prefect.flow` with the same options: Prefect's own flow that runs in-process as a plain
    call (`lowtide.prefect_stages.Pipeline`), or inside `without_prefect()` a `PlainPipeline`."""
    if _PLAIN.get():
        return lambda fn: PlainPipeline(fn, options)
    from lowtide.prefect_stages import Pipeline

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
