"""The crash matrix: a `lowtide run` in a subprocess is SIGKILLed at every named crash point
(`lowtide.crashpoints.ALL_POINTS`) on the openai, anthropic and vllm paths, with several shards,
then the same job is run again in-process, as a nightly schedule would. Crash points fire on an
event (a row written, a batch created, a poll that found work left), never on timing: a cell
whose point is not reached fails, it is never skipped.

After each resume: the run completed, `rows = succeeded + failed` with no row lost (every input
row in the published view with an outcome), no duplicate row in any table of the state file, the
published file opens read-only with exactly one row per input id, no process of the killed run
left, no batch at the provider that the store does not know, and the provider's billing ledger
shows every request executed once. The table of outcomes is written to docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from flows.enrich import enrich
from lowtide.crashpoints import ALL_POINTS, POOL_POINTS, PUBLISH_POINTS
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.vllm_pool import start_engines
from lowtide.jobspec import load_job
from tests.conftest import REPO
from tests.integration.conftest import write_job
from tests.processes import wait_for_exit
from tests.sql import query, scalar

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

BACKENDS = ("openai", "anthropic", "vllm")
ROWS = 40
EVAL_ROWS = 5
SHARD_MAX_REQUESTS = 15  # ~45 requests: 3 or more shards per run
URGENT_ROWS = 4  # in_realtime: rows sent through the realtime path first
VLLM_MODEL = "qwen2.5-7b-instruct"  # the sample job's model id for backend vllm
FAST = 600.0  # the emulator's simulated seconds per real second

_STREAM = "a pool streams: no upload, create, poll or download, and no realtime path"
NOT_APPLICABLE: dict[str, dict[str, str]] = {
    "openai": {"during_stream": "a batch backend does not stream"},
    "anthropic": {"during_stream": "a batch backend does not stream"},
    "vllm": {
        "after_upload": _STREAM,
        "after_create": _STREAM,
        "during_poll": _STREAM,
        "during_download": _STREAM,
        "waiting_for_room": "a pool has no provider queue: its own in-flight cap is the limit",
        "before_release": "a pool leaves nothing at a provider to delete",
        "mid_parse": "answers are parsed and committed as they stream (during_stream)",
        "in_realtime": "no realtime path: urgent rows are the pool's first shard",
    },
}
CELLS = [(p, b) for p in ALL_POINTS for b in BACKENDS if p not in NOT_APPLICABLE[b]]
KNOWN_REPEATS: dict[tuple[str, str], str] = {
    ("during_stream", "vllm"): (
        "requests in flight when the run is killed mid-stream (sent to the engines and answered, "
        "not yet committed) are sent again by the resumed run: a vLLM server has no idempotency "
        "key, so at most what was in flight runs twice (GPU time, not a per-request bill)"
    ),
}
"""Cells where a kill may repeat work by nature: (point, backend) → why. Their repeats are
bounded by the requests one run sends (the pool's in-flight cap is far above this job's size),
never zero-checked; every other cell must repeat nothing."""

_RESULTS: dict[tuple[str, str], dict[str, Any]] = {}


@dataclass
class Provider:
    """What a cell runs against: the environment that points lowtide at it, its billing
    ledger, the batch ids it holds, and how to let its clock run (during_poll freezes it)."""

    env: dict[str, str]
    ledger: BillingLedger
    ledger_name: str
    batch_ids: Callable[[], set[str]]
    thaw: Callable[[], None]


@contextmanager
def _provider(point: str, backend: str) -> Iterator[Provider]:
    if backend == "vllm":
        ledger = BillingLedger()
        config = EngineConfig(time_scale=50.0)
        with start_engines(2, config, ledger=ledger, served_model_name=VLLM_MODEL) as pool:
            env = {"LOWTIDE_VLLM_URLS": ",".join(pool.urls)}
            yield Provider(env, ledger, "vllm", set, lambda: None)
        return
    # during_poll: the clock stands still until the crash, so the first poll always finds the
    # batches running (an event, not a race with a busy machine); the resume lets it run.
    # waiting_for_room likewise: the first batch is never admitted before the crash, so the
    # next waits for it (openai's token limit is unknown until a refusal says it)
    frozen = point in ("during_poll", "waiting_for_room")
    config = EmulatorConfig(
        time_scale=0.0 if frozen else FAST,
        # in_retry_round: per-request server errors (fixed seed) make a second batch round
        error_rate=0.15 if point == "in_retry_round" else 0.0,
        seed=1,
        # waiting_for_room on anthropic: its queue holds one shard, so the second create is a 429
        anthropic_queue_limit=SHARD_MAX_REQUESTS + 5 if point == "waiting_for_room" else None,
    )
    with Emulator(config) as emu:
        if backend == "openai":
            env = {"OPENAI_BASE_URL": emu.openai_base_url, "OPENAI_API_KEY": "x"}
        else:
            env = {"ANTHROPIC_BASE_URL": emu.anthropic_base_url, "ANTHROPIC_API_KEY": "x"}
        yield Provider(
            env,
            emu.ledger,
            backend,
            lambda: set(emu.state.batches) | set(emu.state.message_batches),
            lambda: emu.state.clock.set_time_scale(FAST),
        )


def _job(tmp_path: Path, point: str, backend: str) -> Path:
    extra = "[pool]\ncheckpoint_every = 10\n" if backend == "vllm" else ""
    replace: dict[str, str] = {}
    if point == "in_realtime":
        replace['text_column = "body"'] = 'text_column = "body"\npriority_column = "urgent"'
    if point == "in_retry_round" and backend == "vllm":
        # the pool has no per-request errors to retry: answers cut at max_tokens are re-asked
        # in a retry round with four times the room
        replace["max_tokens = 200\n"] = "max_tokens = 8\n"
        extra += "[retry]\nreask_max_tokens_factor = 4.0\n"
    job = write_job(tmp_path, rows=ROWS, eval_rows=EVAL_ROWS, extra=extra, replace=replace)
    if point == "in_realtime":
        messages = pl.read_csv(tmp_path / "messages.csv")
        urgent = pl.int_range(pl.len()) < URGENT_ROWS
        messages.with_columns(urgent.alias("urgent")).write_csv(tmp_path / "messages.csv")
    return job


def _survivors(point: str, state: str) -> list[int]:
    """Processes the killed run left: any whose environment carries its crash point and this
    test's state file (its own children inherit both; nothing else has them)."""
    marks = {f"LOWTIDE_CRASH_AT={point}".encode(), f"LOWTIDE_STATE={state}".encode()}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if marks <= env:
            found.append(int(proc.name))
    return found


def _orphans(point: str, state: str) -> list[int]:
    """The killed run's processes still there once those it had started have exited (they are
    told to when their parent dies; `wait_for_exit` waits on that event). Anything left then
    was started afterwards by something that survived: killed here, and the cell fails."""
    wait_for_exit(_survivors(point, state))
    left = _survivors(point, state)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


_KEYS = {
    "units": "run_id, unit_id",
    "results": "custom_id",
    "requests": "custom_id",
    "batches": "batch_id",
    "batch_requests": "batch_id, custom_id",
    "failures": "run_id, source_id, kind",
}


def _duplicates(state: str, view: str) -> dict[str, int]:
    """Per table of the state file: rows that repeat another row, or repeat its key."""
    keys = {
        **_KEYS,
        "run_sources": "view, run_id, source_id",
        f"src_{view}-rows": "source_id, lowtide_row_key",
    }
    tables = query(
        state,
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()",
    )["table_name"].to_list()
    found: dict[str, int] = {}
    for table in tables:
        q = f'"{table}"'
        repeats = scalar(
            state,
            f"SELECT count(*) - (SELECT count(*) FROM (SELECT DISTINCT * FROM {q}))  FROM {q}",
        )
        if table in keys:
            repeats += scalar(
                state,
                f"SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM {q} "
                f"GROUP BY {keys[table]})",
            )
        if repeats:
            found[table] = int(repeats)
    return found


def _paid_twice(provider: Provider, state: str, run_ids: list[str]) -> int:
    """Executions beyond the first, summed: per custom_id in the ledger, and for realtime calls
    (which the OpenAI and Anthropic APIs bill without a custom_id) executions beyond the
    requests the runs sent through the realtime path."""
    counts = provider.ledger.count_by_custom_id(provider.ledger_name)
    extra = sum(n - 1 for n in counts.values() if n > 1)
    if provider.ledger_name == "vllm":
        return extra
    realtime_calls = sum(
        1 for e in provider.ledger.executions(provider.ledger_name) if e["kind"] == "realtime"
    )
    realtime_requests = scalar(
        state,
        "SELECT count(DISTINCT br.custom_id) FROM batch_requests br JOIN batches b "
        "USING (batch_id) WHERE b.backend = 'realtime' AND b.status <> 'pending' "
        "AND list_contains(?, b.run_id)",
        [run_ids],
    )
    return extra + max(0, realtime_calls - int(realtime_requests))


@pytest.mark.parametrize(
    ("point", "backend"),
    [
        pytest.param(
            p,
            b,
            id=f"{p}-{b}",
            marks=[],
        )
        for p, b in CELLS
    ],
)
def test_crash_then_resume(
    point: str, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL

    state, db = os.environ["LOWTIDE_STATE"], os.environ["LOWTIDE_DB"]
    job = _job(tmp_path, point, backend)
    spec = load_job(str(job), backend)
    input_ids = set(pl.read_csv(tmp_path / "messages.csv", infer_schema=False)["message_id"])
    monkeypatch.setenv("LOWTIDE_SHARD_MAX_REQUESTS", str(SHARD_MAX_REQUESTS))
    with _provider(point, backend) as provider:
        for name, value in provider.env.items():
            monkeypatch.setenv(name, value)
        env = {
            **os.environ,
            "LOWTIDE_CRASH_AT": point,
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        }
        crashed = subprocess.run(
            [sys.executable, "-m", "lowtide.cli", "run", str(job), "--backend", backend],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert crashed.returncode == -signal.SIGKILL, (
            f"the run did not reach {point}:\n{crashed.stdout}{crashed.stderr}"
        )
        orphans = _orphans(point, state)
        crashed_run = query(state, "SELECT run_id, status FROM runs").row(0, named=True)
        provider.thaw()
        summary = enrich(job_file=str(job), backend=backend)
        run_ids = [crashed_run["run_id"], summary["run_id"]]
        paid_twice = _paid_twice(provider, state, run_ids)
        answered = set(
            query(
                state,
                "SELECT custom_id FROM results WHERE channel <> 'realtime' "
                "AND outcome IN ('ok', 'repaired') AND list_contains(?, run_id)",
                [run_ids],
            )["custom_id"]
        )
        unbilled = answered - set(provider.ledger.count_by_custom_id(provider.ledger_name))
        stray_batches = provider.batch_ids() - set(
            query(state, "SELECT provider_batch_id FROM batches WHERE provider_batch_id NOT NULL")[
                "provider_batch_id"
            ]
        )

    con = duckdb.connect(db, read_only=True)
    try:
        view = pl.from_arrow(
            con.sql(
                f'SELECT "{spec.input.id_column}"::VARCHAR AS id, status, outcome, run_id '
                f'FROM "{spec.view_name}"'
            ).to_arrow_table()
        )
    finally:
        con.close()
    assert isinstance(view, pl.DataFrame)
    shown = set(view.filter(pl.col("outcome").is_not_null())["id"])
    rows_lost = len(input_ids - shown)
    duplicates = _duplicates(state, spec.view_name)
    new_run = summary["run_id"] != crashed_run["run_id"]
    notes = []
    if new_run:
        notes.append(
            f"killed run was already {crashed_run['status']}: the rerun is a new run, which "
            f"sent {summary['requests_sent']} requests (its eval set, asked afresh every run)"
        )
    batches = query(
        state,
        "SELECT count(*) FILTER (WHERE backend <> 'realtime') AS shards, "
        "count(*) FILTER (WHERE attempt > 1) AS retry, "
        "count(*) FILTER (WHERE backend = 'realtime') AS realtime FROM batches "
        "WHERE run_id = ?",
        [crashed_run["run_id"]],
    ).row(0, named=True)
    notes.insert(
        0,
        f"{batches['shards']} batches"
        + (f" ({batches['retry']} in retry rounds)" if batches["retry"] else "")
        + (f", {batches['realtime']} realtime" if batches["realtime"] else ""),
    )
    reasons = summary.get("failures_by_reason") or {}
    if reasons:
        notes.append("failed: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    _RESULTS[(point, backend)] = {
        "outcome": summary["status"] + (" (new run)" if new_run else " (resumed)"),
        "rows": summary["rows"],
        "succeeded": summary["succeeded"],
        "failed": summary["failed"],
        "rows lost": rows_lost,
        "paid twice": paid_twice,
        "duplicates": sum(duplicates.values()),
        "note": "; ".join(notes),
    }

    assert not orphans, f"processes of the killed run still ran: {orphans}"
    assert summary["status"] == "completed"
    assert summary["rows"] == ROWS == summary["succeeded"] + summary["failed"]
    assert rows_lost == 0, input_ids - shown
    assert not new_run, f"a crash at {point} was not resumed: the rerun started over"
    if (point, backend) in KNOWN_REPEATS:
        assert paid_twice <= summary["unique_requests"], "more repeats than requests in flight"
    else:
        assert paid_twice == 0, f"paid twice after a crash at {point} on {backend}"
    assert not unbilled, f"answers the provider never billed: {sorted(unbilled)[:5]}"
    assert not stray_batches, f"batches at the provider the store does not know: {stray_batches}"
    assert not duplicates, duplicates
    assert view.height == ROWS == view["id"].n_unique()
    assert set(view["id"]) == input_ids
    assert (view["status"] == "succeeded").sum() == summary["succeeded"]
    assert set(view["run_id"]) == {summary["run_id"]}
    if point in PUBLISH_POINTS:
        # the run had finished in the store when it was killed; the rerun starts anew
        assert crashed_run["status"] == "completed"
    else:
        assert not new_run, "a crash mid-run must be resumed, not started over"
        assert crashed_run["status"] in ("running", "submitted")


def test_every_crash_point_is_in_the_code_and_the_matrix() -> None:
    """ALL_POINTS names every `crash_point(...)` call in flows/, tasks/ and the store (whose
    slices commit one by one), and each is a cell on at least one backend (the pool's own point
    on vllm)."""
    import re

    called = set()
    for root in ("flows", "tasks", "lowtide/store"):
        for path in (REPO / root).rglob("*.py"):
            called |= set(re.findall(r'crash_point\("(\w+)"\)', path.read_text()))
    assert called == set(ALL_POINTS)
    assert {p for p, _ in CELLS} == set(ALL_POINTS)
    assert {p for p, b in CELLS if b == "vllm"} >= set(POOL_POINTS)


def test_write_the_crash_matrix_table() -> None:
    """Runs after the cells (file order): the table in docs/reliability.md is what they
    measured, written only when every cell ran in this session."""
    import re

    if len(_RESULTS) < len(CELLS):
        pytest.skip("the table is written only when every cell ran in this session")
    lines = []
    for point in ALL_POINTS:
        for backend in BACKENDS:
            if point in NOT_APPLICABLE[backend]:
                reason = NOT_APPLICABLE[backend][point]
                lines.append(f"| {point} | {backend} | n/a | | | | | | | {reason} |")
                continue
            r = _RESULTS[(point, backend)]
            note = r["note"]
            if (point, backend) in KNOWN_REPEATS:
                note = f"known limit: {KNOWN_REPEATS[(point, backend)]}" + (
                    f"; {note}" if note else ""
                )
            lines.append(
                f"| {point} | {backend} | {r['outcome']} | {r['rows']} | {r['succeeded']} | "
                f"{r['failed']} | {r['rows lost']} | {r['paid twice']} | {r['duplicates']} | "
                f"{note} |"
            )
    section = (
        "<!-- crash-matrix:start (written by tests/integration/test_crash_matrix.py) -->\n"
        f"{len(CELLS)} cells: a `lowtide run` of {ROWS} rows and {EVAL_ROWS} eval rows in "
        f"shards of at most {SHARD_MAX_REQUESTS} requests is killed with SIGKILL at the point, "
        "then the job is run again. `rows lost`: input rows without an outcome in the "
        "published view; `paid twice`: executions beyond the first in the provider's billing "
        "ledger, summed; `duplicates`: repeated rows or keys in the state file's tables.\n\n"
        "| point | backend | outcome | rows | succeeded | failed | rows lost | paid twice | "
        "duplicates | note |\n|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(lines)
        + "\n<!-- crash-matrix:end -->"
    )
    doc = REPO / "docs" / "reliability.md"
    text = doc.read_text()
    if "<!-- crash-matrix:start" in text:
        text = re.sub(
            r"<!-- crash-matrix:start.*?<!-- crash-matrix:end -->",
            lambda _: section,
            text,
            flags=re.S,
        )
    else:
        text = text.rstrip() + "\n\n## Crash matrix\n\n" + section + "\n"
    if doc.read_text() != text:
        doc.write_text(text)
