"""Two lowtide processes on one state file, and an analyst on the published file.

- A second `lowtide run` of a job whose run another `lowtide run` is driving exits 2 at once
  with one line naming the holder (host:pid); a scheduled `collect` beside it leaves the run to
  its driver; the first run then finishes with every request executed once.
- A process holding the state file itself makes lowtide wait `LOWTIDE_LOCK_TIMEOUT_S`, then exit
  2 with one line naming the holder's pid; nothing is sent.
- An analyst holding the published file open keeps reading the snapshot they opened while a run
  publishes a new one, and the run succeeds.

Every wait is on an event (the first run's batch exists at the emulator, whose clock is frozen
until the test lets it move), bounded only against a hang. The table goes to
docs/reliability.md."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import duckdb
import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from tests.integration.conftest import lowtide_cli, start_lowtide_run, write_job
from tests.reliability_doc import write_section
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.usefixtures("prefect_harness"),
    pytest.mark.slow,
    pytest.mark.timeout(1200),
]

RESULTS: dict[str, dict[str, Any]] = {}
_BOUND_S = 900  # against a hang only; no assert is about how long anything took


def _env(emu: Emulator, **extra: str) -> dict[str, str]:
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "LOWTIDE_EMULATOR_URL": emu.base_url,
        "LOWTIDE_POLL_MAX_INTERVAL_S": "0.5",
        **extra,
    }


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The shared `lowtide_cli` with this module's environment as the whole one, bounded."""
    return lowtide_cli(*args, cwd=cwd, env=env, timeout=_BOUND_S, inherit=False)


def _state(sql: str) -> list[tuple[Any, ...]]:
    con = duckdb.connect(os.environ["LOWTIDE_STATE"], read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _consistent(emu: Emulator) -> dict[str, int]:
    """The state file after both processes: one run, each batch once, each request billed once,
    rows = succeeded + failed, one published row per input id."""
    runs = _state("SELECT run_id, status, rows, succeeded, failed, requests_sent FROM runs")
    assert len(runs) == 1, runs
    _, status, rows, succeeded, failed, sent = runs[0]
    assert status == "completed" and rows == succeeded + failed
    batches = _state("SELECT count(*), count(DISTINCT provider_batch_id) FROM batches")[0]
    assert batches[0] == batches[1] == len(emu.state.batches)  # no batch created twice
    billed = emu.ledger.count_by_custom_id()
    assert set(billed.values()) == {1} and len(billed) == sent  # each request executed once
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    try:
        ids, distinct = con.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM support_intents"
        ).fetchall()[0]
    finally:
        con.close()
    assert ids == distinct == rows
    return {
        "runs": len(runs),
        "batches": batches[0],
        "executed_twice": sum(1 for n in billed.values() if n > 1),
        "rows": rows,
    }


def _wait_for_batch(emu: Emulator, first: subprocess.Popen[str]) -> None:
    wait_until(
        lambda: bool(emu.state.batches),
        "the first run to create its batch",
        still_going=lambda: first.poll() is None,
        explain=lambda: _output_if_ended(first),
    )


def _output_if_ended(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:  # still running: reading its output would wait for its end
        return "the first run is still running"
    out, err = proc.communicate()
    return f"the first run ended before submitting: {out}{err}"


def test_a_second_run_and_a_collect_beside_a_run_in_flight(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=30, eval_rows=4)
    # a frozen clock: the first run's batch stays in flight until the test moves it
    with Emulator(EmulatorConfig(time_scale=0.0, error_rate=0.0)) as emu:
        env = _env(emu)
        first = start_lowtide_run(job, env, tmp_path)
        try:
            _wait_for_batch(emu, first)
            second = _cli("run", str(job), "--backend", "emulator", env=env, cwd=tmp_path)
            collect = _cli("collect", env=env, cwd=tmp_path)
            assert first.poll() is None  # the first run was in flight all along
            emu.state.clock.set_time_scale(600.0)  # let the provider finish
            out, err = first.communicate(timeout=_BOUND_S)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        assert first.returncode == 0, out + err
        checked = _consistent(emu)

    holder = f"{socket.gethostname()}:{first.pid}:"
    assert second.returncode == 75, second.stdout + second.stderr  # busy: retry later
    (line,) = second.stderr.splitlines()  # one line, naming the process that drives the run
    assert line.startswith("error: run ") and holder in line, line
    assert "is being driven by another lowtide process" in line
    assert second.stdout == ""
    # a scheduled collect leaves a driven run to its driver, exit 0 (a schedule must not fail
    # every time a `lowtide run` is waiting)
    assert collect.returncode == 0, collect.stdout + collect.stderr
    RESULTS["second run"] = {
        "exit": second.returncode,
        "message": line,
        "holder": holder,
        **checked,
    }
    RESULTS["collect"] = {
        "exit": collect.returncode,
        "message": " ".join((collect.stdout + collect.stderr).split()),
        "holder": holder,
        **checked,
    }
    # it names the run and who drives it, never "nothing in flight"
    assert f"driven by {holder}" in collect.stdout and "left to it" in collect.stdout, (
        collect.stdout
    )


def test_a_held_state_file_makes_lowtide_wait_then_name_the_holder(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=4)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        env = _env(emu, LOWTIDE_LOCK_TIMEOUT_S="2")
        holder = duckdb.connect(os.environ["LOWTIDE_STATE"])  # e.g. `duckdb .lowtide/state.duckdb`
        try:
            held_run = _cli("run", str(job), "--backend", "emulator", env=env, cwd=tmp_path)
            held_status = _cli("status", "--json", env=env, cwd=tmp_path)
        finally:
            holder.close()
        assert emu.ledger.executions() == []  # nothing was sent while it waited
        released = _cli("run", str(job), "--backend", "emulator", env=env, cwd=tmp_path)
        assert released.returncode == 0, released.stdout + released.stderr
        checked = _consistent(emu)
    pid = f"(PID {os.getpid()})"
    for name, done in (("run", held_run), ("status", held_status)):
        assert done.returncode == 75, done.stdout + done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith(f"error: state file {os.environ['LOWTIDE_STATE']} is locked by ")
        assert pid in line and "waited 2 s" in line, line
        RESULTS[f"state file held, {name}"] = {
            "exit": done.returncode,
            "message": line,
            "holder": pid,
            **checked,
        }


def test_an_analyst_holding_the_published_file_keeps_the_old_snapshot(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=4)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        env = _env(emu)
        done = _cli("run", str(job), "--backend", "emulator", env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        analyst = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
        try:
            before = analyst.execute("SELECT count(*) FROM support_intents").fetchone()
            write_job(tmp_path, rows=26, eval_rows=4)  # the input grew: a new run
            again = _cli("run", str(job), "--backend", "emulator", env=env, cwd=tmp_path)
            during = analyst.execute("SELECT count(*) FROM support_intents").fetchone()
            runs_seen = analyst.execute("SELECT count(*) FROM runs").fetchone()
        finally:
            analyst.close()
        assert again.returncode == 0, again.stdout + again.stderr
        fresh = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
        try:
            after = fresh.execute(
                "SELECT count(*), count(DISTINCT message_id) FROM support_intents"
            ).fetchone()
            runs_after = fresh.execute("SELECT count(*) FROM runs").fetchone()
        finally:
            fresh.close()
        billed = emu.ledger.count_by_custom_id()
    assert before == during == (20,)  # the snapshot the analyst opened, unchanged
    assert runs_seen == (1,)
    assert after == (26, 26) and runs_after == (2,)  # the new file, one row per id
    assert set(billed.values()) == {1}  # the second run sent only the 6 new rows (+ cache)
    leftovers = [p.name for p in Path(os.environ["LOWTIDE_DB"]).parent.glob(".*.tmp*")]
    assert leftovers == []
    RESULTS["analyst holds the published file"] = {
        "exit": again.returncode,
        "message": f"analyst still reads {during[0]} rows; a new connection reads {after[0]}",
        "holder": "-",
        "runs": runs_after[0],
        "batches": len({e["batch_id"] for e in emu.ledger.executions()}),
        "executed_twice": sum(1 for n in billed.values() if n > 1),
        "rows": after[0],
    }


def test_write_the_concurrency_table(tmp_path: Path) -> None:
    """Runs after the cases (file order): the table in docs/reliability.md."""
    if len(RESULTS) < 5:
        pytest.skip("the cases did not all run in this session")
    host = socket.gethostname()
    lines = [
        "Real `python -m lowtide.cli` processes against the emulator; the first run is held in "
        "flight by a frozen emulator clock until the others have run (events, not timing). "
        "`<host>`, `<pid>`, `<run>` and `<state>` stand for this machine's values.",
        "",
        "| case | exit | message (verbatim) | holder named | runs (after both end) | batches "
        "| executed twice | rows (one per id) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    state = os.environ["LOWTIDE_STATE"]
    for case, r in RESULTS.items():
        message = _generic(r["message"], host, state)
        named = "yes" if r["holder"] == "-" or r["holder"] in r["message"] else "no"
        lines.append(
            f"| {case} | {r['exit']} | `` {message} `` | {named if r['holder'] != '-' else '-'} | "
            f"{r['runs']} | {r['batches']} | {r['executed_twice']} | {r['rows']} |"
        )
    write_section("concurrency", "Concurrency", "\n".join(lines))


def _generic(message: str, host: str, state: str) -> str:
    message = message.replace(host, "<host>")
    message = re.sub(r"<host>:\d+:[0-9a-f]+", "<host>:<pid>:<token>", message)
    message = re.sub(r"\(PID \d+\)", "(PID <pid>)", message)
    message = re.sub(r"support-intents-\d{8}T\d{6}-[0-9a-f]{4}", "<run>", message)
    message = re.sub(r"/\S*?state\.duckdb", "<state>", message)
    message = re.sub(r"locked by \S+python\S*", "locked by <python>", message)
    return message.replace(state, "<state>").replace("|", "\\|")
