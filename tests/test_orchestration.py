"""Flows and tasks inside `in_process()`: plain calls, no Prefect context, a task's retries on
transient provider errors kept, and timings written; outside it they are Prefect's own. Made
inside `without_prefect()` they are plain callables that behave the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from prefect import Flow, Task
from prefect.context import FlowRunContext, TaskRunContext

from lowtide import orchestration
from lowtide.errors import TerminalBackendError, TransientBackendError
from lowtide.orchestration import flow, in_process, retry_transient, task

calls: list[str] = []


@task(
    name="flaky",
    task_run_name="flaky-{key}",
    retries=2,
    retry_delay_seconds=[0, 0],
    retry_condition_fn=retry_transient,
)
def flaky(key: str, failures: list[BaseException]) -> str:
    calls.append(key)
    assert TaskRunContext.get() is None  # no Prefect task run around it
    if failures:
        raise failures.pop(0)
    return f"done {key}"


@flow(name="outer", flow_run_name="outer-{key}")
def outer(key: str, failures: list[BaseException]) -> str:
    assert FlowRunContext.get() is None
    return flaky(key, failures)


@task(name="once-more", retries=1, retry_delay_seconds=0)
def once_more(failures: list[BaseException]) -> str:
    calls.append("once-more")
    if failures:
        raise failures.pop(0)
    return "done"


@task(name="inside")
def inside() -> bool:
    return TaskRunContext.get() is not None


@flow(name="probe")
def probe() -> tuple[bool, bool]:
    return FlowRunContext.get() is not None, inside()


def test_they_are_prefect_flows_and_tasks() -> None:
    assert isinstance(flaky, Task) and isinstance(outer, Flow)
    assert flaky.retries == 2 and outer.name == "outer"


def test_in_process_a_transient_error_is_retried_and_timings_are_written(tmp_path: Path) -> None:
    calls.clear()
    timings = tmp_path / "t.jsonl"
    with in_process(timings):
        result = outer("a", [TransientBackendError("429", backend="x", operation="poll")])
    assert result == "done a"
    assert calls == ["a", "a"]
    lines = [orjson.loads(line) for line in timings.read_bytes().splitlines()]
    assert [(line["kind"], line["run_name"]) for line in lines] == [
        ("task", "flaky-a"),
        ("flow", "outer-a"),
    ]


def test_in_process_retries_stop_at_the_task_limit_and_never_on_terminal_errors() -> None:
    calls.clear()
    transient = [TransientBackendError("503", backend="x", operation="poll") for _ in range(3)]
    with in_process(), pytest.raises(TransientBackendError):
        outer("b", transient)
    assert calls == ["b"] * 3  # the first try and two retries
    calls.clear()
    with in_process(), pytest.raises(TerminalBackendError):
        outer("c", [TerminalBackendError("400", backend="x", operation="poll")])
    assert calls == ["c"]


def test_without_a_condition_any_error_is_retried_as_prefect_does() -> None:
    calls.clear()
    with in_process():
        assert once_more([ValueError("flaky disk")]) == "done"
    assert calls == ["once-more", "once-more"]


def test_an_unwritable_timings_file_does_not_fail_the_stage(tmp_path: Path) -> None:
    calls.clear()
    with in_process(tmp_path / "no-such-folder" / "t.jsonl"):
        assert outer("d", []) == "done d"


@pytest.mark.usefixtures("prefect_harness")
def test_outside_in_process_they_run_through_prefect() -> None:
    with in_process():
        assert probe() == (False, False)
    assert probe() == (True, True)  # the flag ends with the block: Prefect's flow and task runs


def _plain_pair() -> tuple[Any, Any]:
    """A flow around a task (made inside `without_prefect()` by the callers)."""

    @task(
        name="plain",
        task_run_name="plain-{key}",
        retries=1,
        retry_delay_seconds=0,
        retry_condition_fn=retry_transient,
    )
    def plain(key: str, failures: list[BaseException]) -> tuple[str, bool]:
        calls.append(key)
        if failures:
            raise failures.pop(0)
        return f"done {key}", TaskRunContext.get() is not None

    @flow(name="plain-outer", flow_run_name="plain-outer-{key}")
    def plain_outer(key: str, failures: list[BaseException]) -> tuple[str, bool, bool]:
        done, in_task = plain(key, failures)
        return done, FlowRunContext.get() is not None, in_task

    return plain, plain_outer


def test_made_inside_without_prefect_they_are_plain_and_run_in_process_as_before(
    tmp_path: Path,
) -> None:
    with orchestration.without_prefect():
        plain, plain_outer = _plain_pair()
    assert not isinstance(task(name="after")(lambda: None), orchestration.PlainStage)
    assert not isinstance(plain, Task) and not isinstance(plain_outer, Flow)
    assert plain.name == "plain" and plain.retries == 1 and plain_outer.name == "plain-outer"
    calls.clear()
    timings = tmp_path / "t.jsonl"
    with in_process(timings):
        result = plain_outer("e", [TransientBackendError("429", backend="x", operation="poll")])
    assert result == ("done e", False, False)
    assert calls == ["e", "e"]  # retried on the transient error, as Prefect's task would be
    lines = [orjson.loads(line) for line in timings.read_bytes().splitlines()]
    assert [(line["kind"], line["run_name"]) for line in lines] == [
        ("task", "plain-e"),
        ("flow", "plain-outer-e"),
    ]
    calls.clear()
    with in_process(), pytest.raises(TerminalBackendError):
        plain_outer("f", [TerminalBackendError("400", backend="x", operation="poll")])
    assert calls == ["f"]


@pytest.mark.usefixtures("prefect_harness")
def test_plain_ones_called_outside_in_process_run_through_prefect() -> None:
    with orchestration.without_prefect():
        plain, plain_outer = _plain_pair()
    assert plain_outer("g", []) == ("done g", True, True)  # Prefect's flow and task runs
    assert isinstance(plain.prefect, Task) and isinstance(plain_outer.prefect, Flow)
