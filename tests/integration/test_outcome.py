"""An honest outcome for every night, through the real CLI: an exit code by cause (README), a
held or failed night never published over the view and never green in Prefect, and a refused
key that leaves nothing a later run mistakes for the provider's answer.

Real `python -m lowtide.cli` processes (through the session's Prefect server, or in-process
with none configured), the official SDKs over HTTP to the emulator, real DuckDB files; the
emulator's billing ledger says what was executed, and so what was paid for. The table of
nights is written to docs/reliability.md when the whole module runs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from flows.enrich import enrich
from lowtide import routing
from lowtide.backends import backend_entry
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.errors import RunHeldError
from tests.integration.conftest import advance_clock, lowtide_cli, write_job
from tests.key_guard import RequireKey
from tests.reliability_doc import write_section
from tests.sql import query

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

FRAGILE = "[retry]\nmax_attempts = 1\nrealtime_fallback = false\nreask = false\n"
"""What fails stays failed: no second batch, no realtime call, no re-ask."""

RESULTS: dict[str, dict[str, Any]] = {}


@pytest.fixture
def quiet() -> Iterator[Emulator]:
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=3)) as emu:
        yield emu


def _runs() -> list[dict]:
    return query(os.environ["LOWTIDE_STATE"], "SELECT * FROM runs ORDER BY started_at").to_dicts()


def _shown_runs() -> set[str]:
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    try:
        rows = con.execute("SELECT DISTINCT run_id FROM support_intents").fetchall()
    finally:
        con.close()
    return {r[0] for r in rows}


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def _flow_run_states(flow: str) -> list[str]:
    """The state types of the flow's runs on the session's Prefect server, newest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
        )
    return [r.state_type.value for r in runs if r.state_type is not None]


def _paid_twice(emu: Emulator) -> int:
    """Executions beyond the first of any request, in the provider's billing ledger."""
    return sum(n - 1 for n in emu.ledger.count_by_custom_id().values())


def _record(
    case: str, backend: str, exits: list[int], run: dict, paid_twice: int, view: str, flow: str
) -> None:
    RESULTS[case] = {
        "backend": backend,
        "exits": ", then ".join(str(e) for e in exits),
        "outcome": run["status"],
        "rows": run["rows"],
        "succeeded": run["succeeded"],
        "failed": run["failed"],
        "rows lost": run["rows"] - run["succeeded"] - run["failed"],
        "paid twice": paid_twice,
        "view": view,
        "flow": flow,
    }


# -- exit 2 then 0: no key, a refused key ---------------------------------------------------------


def test_no_key_exits_2_then_the_run_with_the_key_answers_every_row(
    quiet: Emulator, tmp_path: Path
) -> None:
    """The refusal leaves the run resumable, its batches unsent: the run with the key sends
    them and answers every row, and nothing is executed twice."""
    job = write_job(tmp_path, rows=12, eval_rows=3)
    env = backend_entry("openai").emulator_env(quiet.base_url)
    key = env.pop("OPENAI_API_KEY")
    no_key = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env)
    assert no_key.returncode == 2, no_key.stdout + no_key.stderr
    (line,) = _lines(no_key.stderr)
    assert line.startswith("error: No API key for backend 'openai': set OPENAI_API_KEY")
    assert quiet.ledger.executions() == [] and quiet.ledger.errors() == []
    (stopped,) = _runs()
    assert stopped["status"] == "running" and "No API key" in stopped["error"]
    assert stopped["failed"] is None and stopped["published_at"] is None
    batches = query(
        os.environ["LOWTIDE_STATE"],
        "SELECT status FROM batches WHERE run_id = ?",
        [stopped["run_id"]],
    )
    assert set(batches["status"]) == {"pending"}  # nothing recorded as the provider's answer
    assert _flow_run_states("enrich")[0] == "FAILED"

    with_key = lowtide_cli(
        "run", str(job), "--backend", "openai", cwd=tmp_path, env=env | {"OPENAI_API_KEY": key}
    )
    assert with_key.returncode == 0, with_key.stdout + with_key.stderr
    assert _flow_run_states("enrich")[0] == "COMPLETED"
    (done,) = _runs()  # the same run, resumed
    assert done["run_id"] == stopped["run_id"] and done["status"] == "completed"
    assert done["succeeded"] == 12 and done["failed"] == 0 and done["error"] is None
    billed = quiet.ledger.count_by_custom_id()
    assert len(billed) == done["unique_requests"] == done["requests_sent"]
    assert _paid_twice(quiet) == 0 and _shown_runs() == {done["run_id"]}
    _record(
        "no key, then the key set", "openai", [2, 0], done, _paid_twice(quiet),
        "the run (once the key was set)", "Failed, then Completed",
    )  # fmt: skip


def test_a_refused_key_exits_2_without_the_key_then_the_right_key_answers_every_row(
    tmp_path: Path,
) -> None:
    """Anthropic answers 401 and echoes the key it was sent: the line says 401, never the key;
    the next run with the right key sends what was refused and nothing twice."""
    job = write_job(tmp_path, rows=12, eval_rows=3)
    wrong, right = "sk-ant-wrong-4c1d2e9f7a", "sk-ant-right-0b8e6a5d3c"
    emu = Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=3))
    guard = RequireKey(emu.app, right, echo=True)
    emu.app = guard
    with emu:
        env = {"ANTHROPIC_BASE_URL": emu.anthropic_base_url}
        refused = lowtide_cli(
            "run", str(job), "--backend", "anthropic", cwd=tmp_path,
            env=env | {"ANTHROPIC_API_KEY": wrong},
        )  # fmt: skip
        assert guard.refused >= 1 and emu.ledger.executions() == []
        assert _flow_run_states("enrich")[0] == "FAILED"
        answered = lowtide_cli(
            "run", str(job), "--backend", "anthropic", cwd=tmp_path,
            env=env | {"ANTHROPIC_API_KEY": right},
        )  # fmt: skip
        paid_twice = _paid_twice(emu)
        billed = emu.ledger.count_by_custom_id()
    assert _flow_run_states("enrich")[0] == "COMPLETED"
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = _lines(refused.stderr)
    assert "anthropic refused the API key (HTTP 401" in line and "ANTHROPIC_API_KEY" in line
    assert wrong not in refused.stdout + refused.stderr
    assert answered.returncode == 0, answered.stdout + answered.stderr
    (done,) = _runs()
    assert done["status"] == "completed" and done["succeeded"] == 12
    assert wrong not in repr(_runs())
    assert len(billed) == done["unique_requests"] and paid_twice == 0
    _record(
        "a key the provider refuses (401), then the right key", "anthropic", [2, 0], done,
        paid_twice, "the run (once the key was right)", "Failed, then Completed",
    )  # fmt: skip


# -- exit 1: every row failed ---------------------------------------------------------------------


def test_every_row_failed_exits_1_unpublished_and_failed_in_prefect(
    quiet: Emulator, tmp_path: Path
) -> None:
    """A good night, then a night whose every request errors (a new prompt, so nothing comes
    from the cache): exit 1 with the main reason, the run `failed`, the view still shows the
    good night, `lowtide publish` refuses it, and its Prefect flow run is Failed."""
    job = write_job(tmp_path, rows=8, eval_rows=2, extra=FRAGILE)
    good = lowtide_cli("run", str(job), cwd=tmp_path, env={"LOWTIDE_EMULATOR_URL": quiet.base_url})
    assert good.returncode == 0, good.stdout + good.stderr
    assert _flow_run_states("enrich")[0] == "COMPLETED"
    (first,) = _runs()

    job.write_text(job.read_text().replace("You sort", "You triage", 1))  # every key renewed
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=1.0, seed=3)) as failing:
        bad = lowtide_cli(
            "run", str(job), cwd=tmp_path, env={"LOWTIDE_EMULATOR_URL": failing.base_url}
        )
        assert failing.ledger.executions() == []  # nothing answered, nothing billed
        paid_twice = _paid_twice(failing)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    (line,) = _lines(bad.stderr)
    second = _runs()[1]
    assert line.startswith(f"error: every row of run {second['run_id']} failed (8 of 8)")
    assert f"run {second['run_id']} — failed" in bad.stdout  # the summary is still printed
    assert second["status"] == "failed" and second["published_at"] is None
    assert second["error"].startswith("every row failed (8 of 8)")
    assert _shown_runs() == {first["run_id"]}
    assert _flow_run_states("enrich")[0] == "FAILED"

    refused = lowtide_cli("publish", second["run_id"], cwd=tmp_path)
    assert refused.returncode == 2 and "a failed run is never published" in refused.stderr
    assert _shown_runs() == {first["run_id"]}
    _record(
        "a bad night: every row failed", "emulator", [1], second, paid_twice,
        "the good night before (`publish` refuses the failed one)", "Failed",
    )  # fmt: skip


# -- exit 3: held by a gate -----------------------------------------------------------------------


def test_over_the_failed_share_the_run_is_held_with_exit_3_until_published(tmp_path: Path) -> None:
    """In-process (no Prefect server configured): the same exit code and line as through
    Prefect. More failed rows than `[qa] max_failed_share` hold the run; `lowtide publish`
    releases it."""
    job = write_job(tmp_path, rows=20, eval_rows=2, extra=FRAGILE)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.3, seed=5)) as emu:
        env = {
            "PREFECT_API_URL": "",  # none: the flow runs in this process, without Prefect
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "LOWTIDE_EMULATOR_URL": emu.base_url,
        }
        held = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
        paid_twice = _paid_twice(emu)
    assert held.returncode == 3, held.stdout + held.stderr
    (run,) = _runs()
    assert 0 < run["failed"] < 20 and run["failed"] / 20 > 0.05, run
    (line,) = _lines(held.stderr)
    assert line.startswith(f"held: {run['failed']} of 20 rows failed")
    assert "[qa] max_failed_share" in line and f"`lowtide publish {run['run_id']}`" in line
    assert run["status"] == "held" and run["published_at"] is None
    assert f"run {run['run_id']} — held" in held.stdout
    assert not (tmp_path / "prefect-home" / "prefect.db").exists()  # it ran without Prefect
    assert _shown_runs() == set()  # the file is written, its view shows no run yet

    released = lowtide_cli("publish", run["run_id"], cwd=tmp_path, env=env)
    assert released.returncode == 0, released.stdout + released.stderr
    assert _shown_runs() == {run["run_id"]}
    assert _runs()[0]["status"] == "completed"
    _record(
        "a bad night: failed share over [qa] max_failed_share (in-process, no Prefect)",
        "emulator", [3], run, paid_twice, "nothing, until `lowtide publish` released it",
        "none (no Prefect server)",
    )  # fmt: skip


def test_a_higher_failed_share_lets_the_same_night_publish(tmp_path: Path) -> None:
    """The threshold is the job's: the same failures under `max_failed_share = 1.0` publish."""
    job = write_job(
        tmp_path, rows=20, eval_rows=2, extra=FRAGILE,
        replace={"seed = 7": "seed = 7\nmax_failed_share = 1.0"},
    )  # fmt: skip
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.3, seed=5)) as emu:
        done = lowtide_cli(
            "run", str(job), cwd=tmp_path, env={"LOWTIDE_EMULATOR_URL": emu.base_url}
        )
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = _runs()
    assert run["status"] == "completed" and run["failed"] > 0
    assert _shown_runs() == {run["run_id"]}


def test_an_unanswered_eval_set_holds_the_run_and_fails_its_flow_run(
    quiet: Emulator, tmp_path: Path
) -> None:
    """Every eval row is empty, so none is asked: the rows are answered, but with no eval
    answer drift cannot be seen, so the run is held (exit 3) and its flow run ends Failed."""
    job = write_job(tmp_path, rows=6, eval_rows=3)
    pl.read_csv(tmp_path / "eval.csv").with_columns(pl.lit("").alias("body")).write_csv(
        tmp_path / "eval.csv"
    )
    held = lowtide_cli("run", str(job), cwd=tmp_path, env={"LOWTIDE_EMULATOR_URL": quiet.base_url})
    assert held.returncode == 3, held.stdout + held.stderr
    (run,) = _runs()
    assert run["status"] == "held" and run["succeeded"] == 6
    (line,) = _lines(held.stderr)
    assert line.startswith("held: the eval set went unanswered (none of its 3 rows")
    assert _flow_run_states("enrich")[0] == "FAILED"
    _record(
        "a bad night: the eval set unanswered", "emulator", [3], run, _paid_twice(quiet),
        "nothing (the held run waits for `lowtide publish`)", "Failed",
    )  # fmt: skip


def test_a_route_whose_step_ends_held_fails_its_flow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `[route]` finishes on its first engine before its time is up, with too many failed
    rows: the step is held like any run, and the enrich flow run that drove it is Failed."""
    monkeypatch.setattr(routing, "clock", lambda: datetime(2026, 12, 1, 1, 0))  # never due
    route = '[route]\nengines = ["emulator", "anthropic"]\nswitch_after_hours = [2]\n'
    job = write_job(tmp_path, rows=20, eval_rows=2, extra=FRAGILE + route)
    before = len(_flow_run_states("enrich"))
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.3, seed=5)) as emu:
        with pytest.raises(RunHeldError, match="rows failed") as held:
            enrich(job_file=str(job), emulator_url=emu.base_url)
        assert _paid_twice(emu) == 0
    s = held.value.summary
    assert s["status"] == "held" and s["route_step"] == 0 and s["published_at"] is None
    states = _flow_run_states("enrich")
    assert len(states) == before + 1 and states[0] == "FAILED"


def test_collect_fails_its_flow_run_and_exits_3_when_it_finishes_a_held_night(
    tmp_path: Path,
) -> None:
    """`run --no-wait`, then the scheduled `collect` finishes the run: held, so the collect
    exits 3 and its flow run is Failed; the next collect has nothing to do."""
    job = write_job(tmp_path, rows=20, eval_rows=2, extra=FRAGILE)
    with Emulator(EmulatorConfig(time_scale=0.0, error_rate=0.3, seed=5)) as emu:
        env = {"LOWTIDE_EMULATOR_URL": emu.base_url}
        sent = lowtide_cli("run", str(job), "--no-wait", cwd=tmp_path, env=env)
        assert sent.returncode == 0, sent.stdout + sent.stderr  # in flight: its clock stands
        assert _flow_run_states("enrich")[0] == "COMPLETED"  # submitted is no bad night yet
        advance_clock(emu, 3600)  # the provider finishes the batch
        for _round in range(20):  # each collect polls once
            collected = lowtide_cli("collect", cwd=tmp_path, env=env)
            if collected.returncode != 0 or "nothing in flight" in collected.stdout:
                break
        again = lowtide_cli("collect", cwd=tmp_path, env=env)
        paid_twice = _paid_twice(emu)
    assert collected.returncode == 3, collected.stdout + collected.stderr
    (run,) = _runs()
    assert run["status"] == "held" and run["published_at"] is None
    assert f"run {run['run_id']} — held" in collected.stdout
    assert f"run {run['run_id']} held: {run['failed']} of 20 rows failed" in collected.stderr
    assert _flow_run_states("collect")[0] == "FAILED"
    assert again.returncode == 0 and "nothing in flight" in again.stdout
    _record(
        "a bad night finished by `collect` (failed share over the threshold)", "emulator",
        [0, 3], run, paid_twice, "nothing (the held run waits for `lowtide publish`)",
        "enrich Completed (submitted), collect Failed",
    )  # fmt: skip


def test_write_the_outcome_table() -> None:
    """Runs after the cases (file order): the table in docs/reliability.md."""
    if len(RESULTS) < 6:
        pytest.skip("the cases did not all run in this session")
    lines = [
        "Each night through `python -m lowtide.cli` against the emulator (`exits`: each command's "
        "exit code in turn). `rows lost`: input rows with neither an answer nor a failure "
        "reason; `paid twice`: executions beyond the first in the provider's billing ledger; "
        "`view`: the run the published job view shows afterwards; `flow run`: the Prefect "
        "flow run's state type (the session's Prefect server).",
        "",
        "| night | backend | exits | outcome | rows | succeeded | failed | rows lost "
        "| paid twice | view | flow run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in RESULTS.items():
        lines.append(
            f"| {case} | {r['backend']} | {r['exits']} | {r['outcome']} | {r['rows']} | "
            f"{r['succeeded']} | {r['failed']} | {r['rows lost']} | {r['paid twice']} | "
            f"{r['view']} | {r['flow']} |"
        )
    write_section("outcome", "Keys and bad nights", "\n".join(lines))
