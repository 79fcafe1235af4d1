"""The fault matrix: each provider fault alone, and several together, on a real run against the
emulator. Every run must end completed (or cancelled, when the fault is a cancel) with every row
succeeded or failed with a reason, nothing lost, and the emulator's billing ledger showing no
request executed twice. The table of outcomes is written to docs/reliability.md.

Besides the provider faults (one parametrized test, on the OpenAI and the Anthropic wire), three
faults of lowtide's own surroundings, each its own test: a vLLM engine of the pool crashing and
coming back, the state file held open by another process, and a full disk under the published
file. Every fault is triggered by an event (answers committed, a process saying it holds the
file), never by how long something took."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pytest

from flows.collect import collect
from flows.enrich import enrich
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.config import parse_faults
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.vllm_pool import start_engines
from lowtide.store import Store
from tests.conftest import REPO
from tests.integration.conftest import (
    advance_clock,
    cancel_through_cli,
    lowtide_cli,
    write_job,
)
from tests.leftovers import assert_nothing_left
from tests.sql import query
from tests.waiting import CountingLedger

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

ROWS = 30


@dataclass(frozen=True)
class Fault:
    name: str
    config: dict[str, Any] = field(default_factory=dict)
    spec: str = ""  # the emulator's fault grammar (docs/emulator.md)
    job_extra: str = ""
    cancel_after_s: float | None = None  # cancel after this much simulated time (clock frozen)
    expect: str = "completed"
    backend: str = "emulator"  # the emulator backend speaks the OpenAI Batch wire


FAST = {"time_scale": 600.0, "error_rate": 0.0, "retry_after_s": 0.05, "seed": 4}
# the clock only moves when the test advances it: 1 h validating, then 60 s per request in
# progress, so a cancel lands in the phase the test chose, whatever the machine's speed
FROZEN = {
    "time_scale": 0.0,
    "error_rate": 0.0,
    "validating_s": 3600,
    "finalizing_s": 1,
    "batch_seconds_per_request": 60.0,
    "cancel_drain_s": 1,
}

FAULTS = [
    Fault("429 storm on create (4 in a row; the SDK does not retry creates)", FAST,
          "429:POST /v1/batches:4"),
    Fault("5xx burst on polling (6 × 503)", FAST, "503:GET /v1/batches/*:6"),
    Fault("5xx on result download (3 × 500)", FAST, "500:GET /v1/files/*/content:3"),
    Fault("connection dropped mid-download", FAST, "drop:GET /v1/files/*/content:1"),
    Fault("slow finalizing (+10 simulated minutes)", FAST, "slow_finalizing:600"),
    Fault("expiry with partial results", {
        "time_scale": 400.0, "error_rate": 0.0, "validating_s": 1, "finalizing_s": 1,
        "batch_seconds_per_request": 1.0, "completion_window_s": 20.0}),
    Fault("5% per-request errors", {**FAST, "error_rate": 0.05}),
    Fault("5% malformed answers", {**FAST, "malformed_rate": 0.05}),
    Fault("every request errors; realtime fallback after 2 batch attempts",
          {**FAST, "error_rate": 1.0}, job_extra="[retry]\nmax_attempts = 2\n"),
    Fault("cancel while the provider validates", FROZEN, cancel_after_s=0, expect="cancelled"),
    Fault("cancel while in progress", FROZEN, cancel_after_s=4200, expect="cancelled"),
    Fault("cancel after the batch already completed", FROZEN, cancel_after_s=7200,
          expect="cancelled"),
    Fault("together: 5% errors + 5% malformed + 429s on create + a dropped download",
          {**FAST, "error_rate": 0.05, "malformed_rate": 0.05},
          "429:POST /v1/batches:2,drop:GET /v1/files/*/content:1,503:GET /v1/batches/*:3"),
    # the same faults on the Anthropic Message Batches wire, through the anthropic SDK
    Fault("5xx burst on polling (6 × 503), Anthropic wire", FAST,
          "503:GET /v1/messages/batches/*:6", backend="anthropic"),
    Fault("5% per-request errors, Anthropic wire", {**FAST, "error_rate": 0.05},
          backend="anthropic"),
]  # fmt: skip

POOL_ENGINE = "a pool engine dies and comes back (vLLM)"
STATE_HELD = "the state file held open by another process"
DISK_FULL = "disk full while writing the published file"
OWN_FAULTS = (POOL_ENGINE, STATE_HELD, DISK_FULL)

_TABLE: dict[str, str] = {}


def _run(job: Path, emu: Emulator, fault: Fault) -> dict[str, Any]:
    if fault.backend == "anthropic":
        return enrich(job_file=str(job), backend="anthropic")
    if fault.cancel_after_s is None:
        return enrich(job_file=str(job), emulator_url=emu.base_url)
    started = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
    if fault.cancel_after_s:
        advance_clock(emu, fault.cancel_after_s)
    cancel_through_cli(emu, started["run_id"])
    advance_clock(emu, 5)
    return collect(emulator_url=emu.base_url)[0]


def _table_row(
    name: str,
    backend: str,
    summary: dict[str, Any],
    paid_twice: int,
    batches: int,
    executions: int,
    realtime: int,
    note: str = "",
) -> str:
    rows_lost = ROWS - (summary["succeeded"] + summary["failed"])
    return (
        f"| {name} | {backend} | {summary['status']} | {ROWS} | {summary['succeeded']} | "
        f"{summary['failed']} | {rows_lost} | {paid_twice} | {batches} | {executions} | "
        f"{realtime} | {note} |"
    )


def _every_row_accounted_for(summary: dict[str, Any]) -> None:
    """The run's rows in the state file: ROWS distinct input rows, rows = succeeded + failed,
    and every failed row with a reason."""
    rows, failed_without_reason = _row_counts(summary["run_id"])
    assert rows == ROWS == summary["succeeded"] + summary["failed"]
    assert failed_without_reason == 0


def _row_counts(run_id: str) -> tuple[int, int]:
    """(distinct input rows of the run, failed rows without a reason) from the state file."""
    store = Store(os.environ["LOWTIDE_STATE"])
    rows = query(
        store,
        "SELECT count(DISTINCT source_id) AS n FROM units WHERE run_id = ? AND kind = 'row'",
        [run_id],
    )["n"][0]
    failed_without_reason = query(
        store,
        "SELECT count(*) AS n FROM failures WHERE run_id = ? AND kind = 'row' "
        "AND (reason IS NULL OR reason = '')",
        [run_id],
    )["n"][0]
    return rows, failed_without_reason


def _published(path: str | Path) -> tuple[int, int, list[str]]:
    """(rows, distinct ids, run ids shown) of the sample job's view in a published file."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        n, distinct = con.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM support_intents"
        ).fetchall()[0]
        runs = [r[0] for r in con.execute("SELECT DISTINCT run_id FROM support_intents").fetchall()]
    finally:
        con.close()
    return n, distinct, runs


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_a_fault_ends_with_every_row_accounted_for_and_nothing_paid_twice(
    tmp_path: Path, fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=fault.job_extra)
    with Emulator(EmulatorConfig(**fault.config)) as emu:
        if fault.backend == "anthropic":  # the anthropic SDK against the emulator, any key
            monkeypatch.setenv("ANTHROPIC_BASE_URL", emu.anthropic_base_url)
            monkeypatch.setenv("ANTHROPIC_API_KEY", "x")
        if fault.spec:
            emu.state.faults.replace(parse_faults(fault.spec))
        summary = _run(job, emu, fault)
        executed = emu.ledger.count_by_custom_id()  # billed batch executions
        assert_nothing_left(emu.base_url, os.environ["LOWTIDE_STATE"], summary["run_id"])
        realtime = sum(1 for e in emu.ledger.executions() if e["kind"] == "realtime")
    assert summary["status"] == fault.expect, summary.get("error")
    paid_twice = sum(n - 1 for n in executed.values() if n > 1)
    store = Store(os.environ["LOWTIDE_STATE"])
    run_id = summary["run_id"]
    rows, failed_without_reason = _row_counts(run_id)
    rows_lost = ROWS - (summary["succeeded"] + summary["failed"])
    batches = store.run_batches(run_id)
    assert rows == ROWS and rows_lost == 0
    assert failed_without_reason == 0
    assert paid_twice == 0, f"{paid_twice} request(s) executed twice under {fault.name}"
    # realtime calls carry no custom_id: at most one per unique request of the run
    assert realtime <= summary["unique_requests"]
    if summary["status"] == "completed":
        con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
        shown = con.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM support_intents"
        ).fetchall()
        con.close()
        assert shown == [(ROWS, ROWS)]
    _TABLE[fault.name] = _table_row(
        fault.name,
        fault.backend,
        summary,
        paid_twice,
        batches.height,
        sum(executed.values()),
        realtime,
    )


POOL_MODEL = "qwen2.5-7b-instruct"  # the sample job's model id for backend vllm
# a fixed cap of 3 in flight per engine, so that when engine 0 dies only a few requests are in
# flight and the rest of the run is left to the engine that came back
POOL_JOB = (
    "[pool]\ncheckpoint_every = 5\nadaptive = false\ninitial_inflight = 3\nmax_inflight = 3\n"
)
DIE_AT, BACK_AT = 10, 20  # requests executed when engine 1 dies / comes back (engine 0 dies)


def test_a_pool_engine_dying_and_coming_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two emulated vLLM engines. Once DIE_AT requests have been executed engine 1 crashes (port
    closed, connections reset); once BACK_AT have, engine 0 crashes for good and engine 1
    restarts on the same port with an empty engine, so the rest can only be answered by the
    engine that came back. (Commits lag the engines by a few groups, so the faults follow the
    engines' executions rather than committed answers.) Every request ends answered; one
    executed twice must be one the pool itself counted as re-sent (sent again after a send that
    got no answer)."""
    import lowtide.backends.vllm_pool as vllm_pool

    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=POOL_JOB)
    ledger = CountingLedger(DIE_AT, BACK_AT)
    pool_stats: list[Any] = []
    run_pool = vllm_pool.run_pool

    def keep_stats(*args: Any, **kwargs: Any) -> Any:  # the pool's own account of each shard
        stats = run_pool(*args, **kwargs)
        pool_stats.append(stats)
        return stats

    monkeypatch.setattr(vllm_pool, "run_pool", keep_stats)
    events: dict[str, int] = {}
    with start_engines(
        2, EngineConfig(time_scale=2.0), ledger=ledger, served_model_name=POOL_MODEL
    ) as pool:
        monkeypatch.setenv("LOWTIDE_VLLM_URLS", ",".join(pool.urls))

        finished = threading.Event()

        def faults() -> None:
            ledger.reached[DIE_AT].wait()  # set by the run's end at the latest
            if finished.is_set():
                return
            pool.stop(1)
            events["died"] = len(ledger.executions())  # executed by the time it was down
            ledger.reached[BACK_AT].wait()
            if finished.is_set():
                return
            pool.stop(0)
            pool.restart(1)
            events["back"] = len(ledger.executions())

        injector = threading.Thread(target=faults, daemon=True)
        injector.start()
        try:
            summary = enrich(job_file=str(job), backend="vllm")
        finally:
            finished.set()  # a fault not reached by now will not be
            for reached in ledger.reached.values():
                reached.set()
            injector.join()
        after_return = pool.engines[1].stats().request_success
    assert set(events) == {"died", "back"}, events
    assert summary["status"] == "completed", summary.get("error")
    _every_row_accounted_for(summary)
    assert summary["failed"] == 0  # every request answered, none given up on
    answered_after_return = after_return.get("stop", 0) + after_return.get("length", 0)
    assert answered_after_return > 0, (events, after_return)
    executed = ledger.count_by_custom_id()
    assert len(executed) == summary["unique_requests"]  # each request executed at least once
    resent = Counter(cid for stats in pool_stats for cid in stats.resent)
    repeats = {cid: n - 1 for cid, n in executed.items() if n > 1}
    unexplained = {cid: n for cid, n in repeats.items() if n > resent[cid]}
    assert not unexplained, f"executed again without the pool re-sending them: {unexplained}"
    assert _published(os.environ["LOWTIDE_DB"])[:2] == (ROWS, ROWS)
    batches = Store(os.environ["LOWTIDE_STATE"]).run_batches(summary["run_id"]).height
    failovers = sum(stats.failovers for stats in pool_stats)
    _TABLE[POOL_ENGINE] = _table_row(
        POOL_ENGINE,
        "vllm",
        summary,
        sum(repeats.values()),
        batches,
        sum(executed.values()),
        0,
        f"engine 1 crashed at the {DIE_AT}th execution (down by the {events['died']}th) and "
        f"came back at the {BACK_AT}th, when engine 0 crashed for good; {answered_after_return} "
        f"answered by it after its return; {failovers} failovers; {sum(resent.values())} "
        "re-sent after a send without an answer, each counted in the pool's stats",
    )


_HOLD = """import sys, duckdb
con = duckdb.connect(sys.argv[1])  # a writer, as `duckdb state.duckdb` would be
print("holding", flush=True)
sys.stdin.readline()
con.close()
"""


def test_the_state_file_held_by_another_process(tmp_path: Path) -> None:
    """Another process holds the state file open for writing while `lowtide run` starts: the
    run waits LOWTIDE_LOCK_TIMEOUT_S, exits 2 with one line naming the file and the holder's
    PID, and sends nothing; once the holder lets go, the same run completes."""
    job = write_job(tmp_path, rows=ROWS, eval_rows=5)
    state = os.environ["LOWTIDE_STATE"]
    Path(state).parent.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, state],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "holding"  # the event: it holds the file
        with Emulator(EmulatorConfig(**FAST)) as emu:
            env = {"LOWTIDE_EMULATOR_URL": emu.base_url, "LOWTIDE_LOCK_TIMEOUT_S": "2"}
            held = lowtide_cli("run", str(job), "--backend", "emulator", cwd=tmp_path, env=env)
            sent_while_held = len(emu.ledger.executions()) + len(emu.ledger.errors())
            batches_while_held = len(emu.state.batches)
            holder.stdin.write("release\n")
            holder.stdin.flush()
            assert holder.wait(timeout=60) == 0
            summary = enrich(job_file=str(job), emulator_url=emu.base_url)
            executed = emu.ledger.count_by_custom_id()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert held.returncode == 75, held.stdout + held.stderr  # retry later: nothing is wrong
    (line,) = held.stderr.splitlines()
    assert line.startswith(f"error: state file {state} is locked by "), line
    assert f"(PID {holder.pid})" in line and "waited 2 s" in line, line
    assert sent_while_held == 0 and batches_while_held == 0
    assert summary["status"] == "completed", summary.get("error")
    _every_row_accounted_for(summary)
    paid_twice = sum(n - 1 for n in executed.values() if n > 1)
    assert paid_twice == 0 and len(executed) == summary["requests_sent"]
    assert _published(os.environ["LOWTIDE_DB"])[:2] == (ROWS, ROWS)
    batches = Store(state).run_batches(summary["run_id"]).height
    _TABLE[STATE_HELD] = _table_row(
        STATE_HELD,
        "emulator",
        summary,
        paid_twice,
        batches,
        sum(executed.values()),
        0,
        "the held run exited 75 after waiting 2 s, naming the file and the holder's PID, and "
        "sent 0 requests; after the holder let go, a rerun completed",
    )


# Runs `lowtide run` in a user and mount namespace of its own (no root needed where
# unprivileged user namespaces are allowed), with the published file's folder on a tmpfs that
# holds the old published file and little more: the new file cannot be written (ENOSPC). What
# the folder holds afterwards is copied out for the test to read.
_FULL_DISK = r"""set -e
cp "$PUBLISHED" "$SAVED"
mount -t tmpfs -o size="$TMPFS_BYTES" lowtide-full "$(dirname "$PUBLISHED")"
cp "$SAVED" "$PUBLISHED"
df -B1 "$(dirname "$PUBLISHED")" > "$AFTER/df-before"
set +e
"$@"
rc=$?
ls -A "$(dirname "$PUBLISHED")" > "$AFTER/listing"
cp "$PUBLISHED" "$AFTER/published.duckdb"
exit $rc
"""


def _user_namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
    )
    return probe.returncode == 0


def test_disk_full_while_writing_the_published_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose published file cannot be written (its filesystem is full) ends completed but
    unpublished, with an error that says how to retry; the old published file is untouched and
    readable; once there is space again, rerunning the job publishes the run and asks the
    provider nothing."""
    if not _user_namespaces():
        pytest.skip("needs `unshare --user --map-root-user --mount` to mount a small tmpfs")
    from prefect.settings import PREFECT_API_URL

    published = tmp_path / "published" / "lowtide.duckdb"
    monkeypatch.setenv("LOWTIDE_DB", str(published))
    job = write_job(tmp_path, rows=ROWS, eval_rows=5)
    after = tmp_path / "after"
    after.mkdir()
    with Emulator(EmulatorConfig(**FAST)) as emu:
        first = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert first["status"] == "completed"
        old_bytes = published.read_bytes()
        first_executions = sum(emu.ledger.count_by_custom_id().values())
        # a new run (another temperature: other requests), published onto a full disk
        job.write_text(job.read_text().replace("temperature = 0.0", "temperature = 0.1"))
        env = {
            **os.environ,
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
            "LOWTIDE_EMULATOR_URL": emu.base_url,
            "PUBLISHED": str(published),
            "SAVED": str(tmp_path / "saved.duckdb"),
            "AFTER": str(after),
            # room for the old file and 64 KiB: too little for a second copy of the data
            "TMPFS_BYTES": str(len(old_bytes) + 64 * 1024),
        }
        if not env["PREFECT_API_URL"]:
            del env["PREFECT_API_URL"]
        full = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", _FULL_DISK, "sh",
             sys.executable, "-m", "lowtide.cli", "run", str(job), "--backend", "emulator"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        sent_by_full_run = emu.ledger.count_by_custom_id()
        status = lowtide_cli("status", "--json", cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        runs = {r["run_id"]: r for r in orjson.loads(status.stdout)}
        second = next(r for r in runs.values() if r["run_id"] != first["run_id"])
        # space is back: the same job again
        again = enrich(job_file=str(job), emulator_url=emu.base_url)
        executed = emu.ledger.count_by_custom_id()
    output = full.stdout + full.stderr
    assert full.returncode == 1, output
    assert "No space left on device" in output and "cannot write the published file" in output
    assert f"lowtide publish {second['run_id']}" in output, output
    # the old file, as the full disk held it after the failure: unchanged, readable, alone
    assert (after / "listing").read_text().split() == ["lowtide.duckdb"]
    assert (after / "published.duckdb").read_bytes() == old_bytes
    assert _published(after / "published.duckdb") == (ROWS, ROWS, [first["run_id"]])
    # `status`: completed, not published, its error saying how to publish it
    assert second["status"] == "completed" and second["published_at"] is None, second
    assert "No space left on device" in second["error"], second["error"]
    # the rerun published that run and sent nothing
    assert again["run_id"] == second["run_id"] and again["status"] == "completed", again
    assert executed == sent_by_full_run
    _every_row_accounted_for(again)
    assert _published(published) == (ROWS, ROWS, [second["run_id"]])
    paid_twice = sum(n - 1 for n in executed.values() if n > 1)
    assert paid_twice == 0
    batches = Store(os.environ["LOWTIDE_STATE"]).run_batches(again["run_id"]).height
    _TABLE[DISK_FULL] = _table_row(
        DISK_FULL,
        "emulator",
        again,
        paid_twice,
        batches,
        sum(executed.values()) - first_executions,
        0,
        f"the run exited {full.returncode} completed but unpublished (ENOSPC on a "
        f"{int(env['TMPFS_BYTES']) // 1024} KiB tmpfs); the old file stayed byte for byte and "
        "readable; the rerun published it sending 0 requests",
    )


def test_write_the_fault_table() -> None:
    """Runs after the matrix (file order); the table is only written when all of it ran."""
    names = [f.name for f in FAULTS] + list(OWN_FAULTS)
    if set(_TABLE) != set(names):
        pytest.skip("the table is written only when every fault ran in this session")
    section = (
        "<!-- fault-matrix:start (written by tests/integration/test_fault_matrix.py) -->\n"
        f"{len(names)} faults on a {ROWS}-row run of the sample job (and 5 eval rows). Backend "
        "`emulator` speaks the OpenAI Batch wire, `anthropic` the Message Batches wire through "
        "the anthropic SDK, both against the emulator; `vllm` is a pool of two emulated engines. "
        "`paid twice` counts executions beyond the first in the billing ledger; `rows lost` "
        "are input rows with neither an answer nor a failure reason; `executions` are the "
        "ledger's billed executions of the run's requests. Each fault is triggered by an event "
        "(a call count, the engines' executions, a process holding a file), never by elapsed "
        "time.\n\n"
        "| fault | backend | outcome | rows | succeeded | failed | rows lost | paid twice | "
        "batches | executions | realtime calls | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(_TABLE[name] for name in names)
        + "\n<!-- fault-matrix:end -->"
    )
    doc = REPO / "docs" / "reliability.md"
    text = doc.read_text() if doc.is_file() else "# Reliability\n"
    pattern = r"<!-- fault-matrix:start.*?<!-- fault-matrix:end -->"
    if re.search(pattern, text, flags=re.S):
        text = re.sub(pattern, lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n## Faults\n\n" + section + "\n"
    doc.write_text(text)
