"""`[route]` in the job file (`lowtide/routing.py`): when each step gives way, where a switch
past the deadline goes, the clear errors, and the quote of a route (`lowtide estimate`)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from lowtide.cli import app
from lowtide.jobspec import JobFileError, load_job
from lowtide.routing import RouteSpec
from tests.integration.conftest import write_job

START = datetime(2026, 12, 1, 0, 0)
THREE = ["anthropic", "openai", "vllm"]


def test_each_step_ends_at_its_own_hours_or_the_deadline_whichever_comes_first() -> None:
    route = RouteSpec(engines=THREE, deadline=8, switch_after_hours=[2, 4])
    assert route.step_ends_at(0, START, START) == START + timedelta(hours=2)
    later = START + timedelta(hours=5)  # step 1 began late: the deadline cuts its 4 hours
    assert route.step_ends_at(1, later, START) == START + timedelta(hours=8)
    assert route.step_ends_at(2, later, START) is None  # the last step runs to its end


def test_a_switch_past_the_deadline_goes_straight_to_the_last_engine() -> None:
    route = RouteSpec(engines=THREE, deadline=8, switch_after_hours=[2, 4])
    assert route.next_step(0, START + timedelta(hours=2), START) == 1
    assert route.next_step(0, START + timedelta(hours=8), START) == 2


def test_an_absolute_deadline_is_read_in_its_own_time_zone() -> None:
    route = RouteSpec(engines=["openai", "vllm"], deadline=datetime(2026, 12, 1, 7, 0, tzinfo=UTC))
    assert route.deadline_at(START) == datetime(2026, 12, 1, 7, 0)
    assert route.step_ends_at(0, START, START) == datetime(2026, 12, 1, 7, 0)


@pytest.mark.parametrize(
    ("route", "message"),
    [
        ('engines = ["openai"]\ndeadline = 4', "at least 2"),
        ('engines = ["openai", "bedrock"]\ndeadline = 4', "unknown engine"),
        ('engines = ["openai", "openai"]\ndeadline = 4', "once in a route"),
        ('engines = ["openai", "vllm-run-batch"]\ndeadline = 4', "cannot switch"),
        ('engines = ["openai", "vllm"]', "never switches"),
        ('engines = ["openai", "vllm"]\nswitch_after_hours = [1, 2]', "one per step"),
        ('engines = ["openai", "vllm"]\nswitch_after_hours = [-1]', "negative"),
        ('engines = ["openai", "vllm"]\ndeadline = 2026-12-01T06:00:00', "time zone"),
        ('engines = ["openai", "vllm"]\ndeadline = 0', "above 0"),
        ('engines = ["openai", "vllm"]\ndeadline = "8"', "without quotes"),
        ('engines = ["vllm", "openai"]\ndeadline = 4', "put such an engine last"),
        ('engines = ["openai", "vllm"]\ndeadline = 4\nafter = 1', "after"),
    ],
)
def test_a_bad_route_is_one_clear_line_naming_it(tmp_path: Path, route: str, message: str) -> None:
    job = write_job(tmp_path, rows=5, eval_rows=5, extra=f"[route]\n{route}\n")
    with pytest.raises(JobFileError, match=message) as info:
        load_job(job)
    assert "route" in str(info.value)


def test_a_routed_job_starts_on_its_first_engine_with_that_engines_model(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        rows=5,
        eval_rows=5,
        extra='[route]\nengines = ["anthropic", "openai"]\ndeadline = 6\n',
    )
    spec = load_job(job)
    assert (spec.model.backend, spec.model.name) == ("anthropic", "claude-haiku-4-5")
    assert spec.route_models == {"anthropic": "claude-haiku-4-5", "openai": "gpt-4o-mini"}
    assert load_job(job, "openai").model.name == "gpt-4o-mini"  # --backend: that engine only


def test_estimate_prices_every_step_of_the_route(tmp_path: Path) -> None:
    job = write_job(
        tmp_path, rows=10, eval_rows=5,
        extra='[route]\nengines = ["anthropic", "openai", "vllm"]\ndeadline = 8\n',
    )  # fmt: skip
    result = CliRunner().invoke(app, ["estimate", str(job), "--json"])
    assert result.exit_code == 0, result.output
    q = orjson.loads(result.output)
    steps = q["route"]["steps"]
    assert [s["engine"] for s in steps] == THREE
    assert steps[0]["usd"] == q["by_backend"]["anthropic"]["batch_usd"] == q["route"]["best_usd"]
    assert steps[1]["usd"] == q["by_backend"]["openai"]["batch_usd"]
    assert steps[2]["usd"] is None and q["route"]["unpriced"] == ["vllm"]  # no gpu_hour_usd
    assert q["route"]["worst_usd"] == max(steps[0]["usd"], steps[1]["usd"])
    assert q["backend"] == "anthropic"
    plain = CliRunner().invoke(app, ["estimate", str(job), "--json", "--backend", "openai"])
    assert "route" not in orjson.loads(plain.output)  # one engine asked for: no route
