"""Prefect's own task and flow, made to run as plain calls inside `in_process()`
(`lowtide.orchestration`). Imported only where Prefect runs them, or may: this module imports
Prefect (~0.8 s of CPU)."""

from __future__ import annotations

from typing import Any

from prefect import Flow, Task

from lowtide.orchestration import call_flow, call_task, in_process_now


class Stage(Task):
    """A Prefect task that, inside `in_process()`, is a plain call of its function, retried as
    Prefect would (`call_task`). (`with_options`, `.submit` and `.map` give or use Prefect's own
    task: the flows here do not use them.)"""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_process_now():
            return super().__call__(*args, **kwargs)
        return call_task(self, args, kwargs)


class Pipeline(Flow):
    """A Prefect flow that, inside `in_process()`, is a plain call of its function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not in_process_now():
            return super().__call__(*args, **kwargs)
        return call_flow(self, args, kwargs)
