"""`[route]` end to end: a slow engine (the emulator's OpenAI Batch wire on a frozen clock) gives
way to a fast one (the Message Batches wire through the anthropic SDK, a second emulator) when
its step's time is up. Time on lowtide's side moves only when the test moves `routing.clock`;
on the slow emulator only when the test advances its clock. Nothing depends on machine speed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest

from flows.collect import collect
from flows.enrich import enrich
from lowtide import routing
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.config import parse_faults
from lowtide.errors import TransientBackendError
from lowtide.store import Store
from tests.integration.conftest import advance_clock, write_job

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

ROWS = 30
VALIDATING_S = 3600
PER_REQUEST_S = 60
ROUTE = '[route]\nengines = ["emulator", "anthropic"]\nswitch_after_hours = [2]\n'
# the eval set is asked once, like the rows (so a second night asks nothing at all)
ONCE = {'eval_id_column = "eval_id"': 'eval_id_column = "eval_id"\neval_every_run = false'}


def _slow(cancel_drain_s: float) -> Emulator:
    return Emulator(
        EmulatorConfig(
            time_scale=0.0,
            error_rate=0.0,
            validating_s=VALIDATING_S,
            finalizing_s=1,
            batch_seconds_per_request=PER_REQUEST_S,
            cancel_drain_s=cancel_drain_s,
        )
    )


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    """The second engine: the anthropic SDK against an emulator that answers quickly."""
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=5)) as emu:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", emu.anthropic_base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "x")
        yield emu


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[datetime]:
    """lowtide's route clock, moved by the test: `now[0] += ...`."""
    moment = [datetime(2026, 12, 1, 1, 0)]
    monkeypatch.setattr(routing, "clock", lambda: moment[0])
    return moment


def _collect_until_done(slow: Emulator) -> list[dict[str, Any]]:
    """`collect` on its schedule until nothing is in flight (bounded against a hang only)."""
    store = Store(os.environ["LOWTIDE_STATE"])
    touched: list[dict[str, Any]] = []
    for _ in range(200):
        if not store.in_flight_runs():
            return touched
        advance_clock(slow, 5)
        touched += collect(emulator_url=slow.base_url)
    raise AssertionError("runs still in flight after 200 collects")


def _view() -> list[tuple[str, str, str]]:
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    try:
        return con.execute(
            "SELECT message_id::VARCHAR, status, answered_by FROM support_intents ORDER BY 1"
        ).fetchall()
    finally:
        con.close()


def _chunk_engines() -> dict[str, int]:
    """Chunks of the job's view per engine that answered them (a long row has several)."""
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    try:
        rows = con.execute(
            "SELECT answered_by, count(*) FROM support_intents_chunks GROUP BY 1"
        ).fetchall()
    finally:
        con.close()
    return dict(rows)


def _row_answers(store: Store, run_id: str) -> int:
    """Row units the run's own requests answered (not reused from another run)."""
    return store._scalar(  # noqa: SLF001 - a test reads the state file directly
        "SELECT count(*) FROM units u JOIN results r ON r.custom_id = u.custom_id "
        "AND r.run_id = u.run_id WHERE u.run_id = ? AND u.kind = 'row' "
        "AND r.outcome IN ('ok', 'repaired', 'reasked')",
        [run_id],
    )


def test_a_switch_keeps_what_the_slow_engine_answered_and_sends_only_the_rest(
    tmp_path: Path, fast: Emulator, now: list[datetime]
) -> None:
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=ROUTE, replace=ONCE)
    with _slow(cancel_drain_s=0) as slow:
        first = enrich(job_file=str(job), emulator_url=slow.base_url, wait=False)
        assert first["backend"] == "emulator" and first["status"] == "submitted"
        assert [s["engine"] for s in first["route"]["steps"]] == ["emulator"]
        # ten requests run on the slow engine; the step still has time: nothing switches
        advance_clock(slow, VALIDATING_S + 10 * PER_REQUEST_S)
        now[0] += timedelta(hours=1)
        assert collect(emulator_url=slow.base_url)[0]["run_id"] == first["run_id"]
        assert Store(os.environ["LOWTIDE_STATE"]).get_run(first["run_id"])["switched_at"] is None
        # its time is up: cancelled at the provider, what it answered is kept, the rest goes on
        now[0] += timedelta(hours=1, minutes=1)
        second = collect(emulator_url=slow.base_url)[0]
        assert second["backend"] == "anthropic", second
        _collect_until_done(slow)
        slow_runs = slow.ledger.count_by_custom_id()
    store = Store(os.environ["LOWTIDE_STATE"])
    step0 = store.get_run(first["run_id"])
    assert step0["status"] == "cancelled" and step0["switched_at"] is not None
    kept = _row_answers(store, first["run_id"])
    assert kept >= 10  # the ten it finished (and the one running when the cancel came)
    final = store.run_summary(second["run_id"])
    assert final["status"] == "completed" and final["succeeded"] == ROWS
    view = _view()
    assert len(view) == ROWS and {status for _, status, _ in view} == {"succeeded"}
    units = final["units"]
    assert _chunk_engines() == {"emulator": kept, "anthropic": units - kept}
    # nothing asked twice: the fast engine got only what the slow one had not answered
    fast_runs = fast.ledger.count_by_custom_id()
    assert max(fast_runs.values()) == 1 and max(slow_runs.values()) == 1
    assert _row_answers(store, second["run_id"]) == units - kept
    assert store.route_summary(second["run_id"])["paid_twice"] == {"requests": 0, "cost_usd": 0.0}


def test_an_answer_that_ends_after_the_switch_is_kept_once_and_reported_paid_twice(
    tmp_path: Path, fast: Emulator, now: list[datetime]
) -> None:
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=ROUTE, replace=ONCE)
    with _slow(cancel_drain_s=30) as slow:
        first = enrich(job_file=str(job), emulator_url=slow.base_url, wait=False)
        advance_clock(slow, VALIDATING_S + 8 * PER_REQUEST_S)
        now[0] += timedelta(hours=3)
        # the cancel takes 30 simulated seconds to drain: nothing of the slow step has ended
        # when the switch sends every row to the fast engine
        second = collect(emulator_url=slow.base_url)[0]
        assert second["backend"] == "anthropic"
        assert second["cache_hits"] == 0
        assert second["unique_requests"] == first["unique_requests"]
        advance_clock(slow, 60)  # the slow batch ends cancelled, with what it had done
        _collect_until_done(slow)
    store = Store(os.environ["LOWTIDE_STATE"])
    late = store._scalar(  # noqa: SLF001 - distinct requests (duplicate rows share one)
        "SELECT count(DISTINCT u.custom_id) FROM units u JOIN results r ON "
        "r.custom_id = u.custom_id AND r.run_id = u.run_id WHERE u.run_id = ? "
        "AND u.kind = 'row' AND r.outcome IN ('ok', 'repaired', 'reasked')",
        [first["run_id"]],
    )
    assert late >= 8
    summary = store.run_summary(second["run_id"])
    paid = store.route_summary(second["run_id"])["paid_twice"]
    assert paid["requests"] == late and paid["cost_usd"] > 0
    assert summary["metrics"]["paid_twice_requests"] == late
    # kept once: the view shows the fast engine's answer for every row
    view = _view()
    assert len(view) == ROWS and {a for *_, a in view} == {"anthropic"}


def test_a_waiting_run_watches_the_step_time_and_a_second_night_asks_nothing(
    tmp_path: Path, fast: Emulator
) -> None:
    # the real clock: the slow engine never moves, so the switch comes from the step's time
    # (about a second) however busy the machine is
    route = ROUTE.replace("[2]", "[0.0003]")
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=route, replace=ONCE)
    with _slow(cancel_drain_s=0) as slow:
        summary = enrich(job_file=str(job), emulator_url=slow.base_url)
        assert summary["status"] == "completed" and summary["backend"] == "anthropic"
        steps = summary["route"]["steps"]
        assert [(s["engine"], s["status"]) for s in steps] == [
            ("emulator", "cancelled"),
            ("anthropic", "completed"),
        ]
        assert {a for *_, a in _view()} == {"anthropic"}
        before = sum(fast.ledger.count_by_custom_id().values())
        again = enrich(job_file=str(job), emulator_url=slow.base_url)
        assert again["status"] == "completed", again
        assert again["unique_requests"] == again["cache_hits"]
        assert sum(fast.ledger.count_by_custom_id().values()) == before
        assert slow.ledger.count_by_custom_id() == {}


def test_a_provider_outage_falls_over_to_the_next_engine_when_the_step_time_is_up(
    tmp_path: Path, fast: Emulator, now: list[datetime]
) -> None:
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=ROUTE, replace=ONCE)
    with _slow(cancel_drain_s=0) as slow:
        # the first engine refuses every batch (503) for as long as the test runs
        slow.state.faults.replace(parse_faults("503:POST /v1/batches:100000"))
        with pytest.raises(TransientBackendError):
            enrich(job_file=str(job), emulator_url=slow.base_url, wait=False)
        store = Store(os.environ["LOWTIDE_STATE"])
        (step0,) = store.in_flight_runs()
        assert store.get_run(step0["run_id"])["error"]  # resumable, with its error
        now[0] += timedelta(hours=2, minutes=1)  # the step's time is up: the next try switches
        second = collect(emulator_url=slow.base_url)[0]
        assert second["backend"] == "anthropic"
        _collect_until_done(slow)
        assert slow.ledger.count_by_custom_id() == {}
    assert store.get_run(step0["run_id"])["status"] == "cancelled"
    final = store.run_summary(second["run_id"])
    assert final["status"] == "completed" and final["succeeded"] == ROWS
    assert {a for *_, a in _view()} == {"anthropic"}


def test_a_route_past_its_deadline_opens_only_the_last_engine(
    tmp_path: Path, fast: Emulator, now: list[datetime]
) -> None:
    route = '[route]\nengines = ["emulator", "anthropic"]\ndeadline = 2026-12-01T00:30:00Z\n'
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=route, replace=ONCE)
    with _slow(cancel_drain_s=0) as slow:  # now[0] is 01:00, half an hour past the deadline
        summary = enrich(job_file=str(job), emulator_url=slow.base_url)
        assert slow.ledger.count_by_custom_id() == {}
    assert summary["status"] == "completed" and summary["backend"] == "anthropic"
    assert [s["engine"] for s in summary["route"]["steps"]] == ["anthropic"]


def test_a_step_switched_before_its_cancel_was_sent_is_cancelled_by_collect(
    tmp_path: Path, fast: Emulator, now: list[datetime]
) -> None:
    # what a crash right after the switch was recorded leaves: the step marked switched, its
    # batch still running at the provider, the next step never opened
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=ROUTE, replace=ONCE)
    with _slow(cancel_drain_s=0) as slow:
        first = enrich(job_file=str(job), emulator_url=slow.base_url, wait=False)
        store = Store(os.environ["LOWTIDE_STATE"])
        store.mark_switched(first["run_id"])
        touched = collect(emulator_url=slow.base_url)
        assert [t["backend"] for t in touched] == ["anthropic"]  # the next step, opened
        assert store.get_run(first["run_id"])["status"] == "cancelled"
        assert {b.status for b in slow.state.batches.values()} == {"cancelled"}
        _collect_until_done(slow)
        assert slow.ledger.count_by_custom_id() == {}  # cancelled while still validating
    final = store.run_summary(touched[0]["run_id"])
    assert final["status"] == "completed" and final["succeeded"] == ROWS
