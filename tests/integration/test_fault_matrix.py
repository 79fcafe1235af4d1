"""The fault matrix: each provider fault alone, and several together, on a real run against the
emulator. Every run must end completed (or cancelled, when the fault is a cancel) with every row
succeeded or failed with a reason, nothing lost, and the emulator's billing ledger showing no
request executed twice. The table of outcomes is written to docs/reliability.md."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pytest

from flows.collect import collect
from flows.enrich import enrich
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.config import parse_faults
from lowtide.store import Store
from tests.conftest import REPO
from tests.integration.conftest import advance_clock, cancel_through_cli, write_job
from tests.sql import query

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
]  # fmt: skip

_TABLE: dict[str, str] = {}


def _run(job: Path, emu: Emulator, fault: Fault) -> dict[str, Any]:
    if fault.cancel_after_s is None:
        return enrich(job_file=str(job), emulator_url=emu.base_url)
    started = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
    if fault.cancel_after_s:
        advance_clock(emu, fault.cancel_after_s)
    cancel_through_cli(emu, started["run_id"])
    advance_clock(emu, 5)
    return collect(emulator_url=emu.base_url)[0]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_a_fault_ends_with_every_row_accounted_for_and_nothing_paid_twice(
    tmp_path: Path, fault: Fault
) -> None:
    job = write_job(tmp_path, rows=ROWS, eval_rows=5, extra=fault.job_extra)
    with Emulator(EmulatorConfig(**fault.config)) as emu:
        if fault.spec:
            emu.state.faults.replace(parse_faults(fault.spec))
        summary = _run(job, emu, fault)
        executed = emu.ledger.count_by_custom_id()  # billed batch executions
        realtime = sum(1 for e in emu.ledger.executions() if e["kind"] == "realtime")
    assert summary["status"] == fault.expect, summary.get("error")
    paid_twice = sum(n - 1 for n in executed.values() if n > 1)
    store = Store(os.environ["LOWTIDE_STATE"])
    run_id = summary["run_id"]
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
    _TABLE[fault.name] = (
        f"| {fault.name} | {summary['status']} | {ROWS} | {summary['succeeded']} | "
        f"{summary['failed']} | {rows_lost} | {paid_twice} | {batches.height} | "
        f"{len(executed)} | {realtime} |"
    )


def test_write_the_fault_table() -> None:
    """Runs after the matrix (file order); the table is only written when all of it ran."""
    if len(_TABLE) < len(FAULTS):
        pytest.skip("the table is written only when every fault ran in this session")
    section = (
        "<!-- fault-matrix:start (written by tests/integration/test_fault_matrix.py) -->\n"
        f"{len(FAULTS)} faults on a {ROWS}-row run of the sample job through the emulator "
        "(OpenAI wire format). `paid twice` counts executions beyond the first in the "
        "emulator's billing ledger; `rows lost` are input rows with neither an answer nor a "
        "failure reason.\n\n"
        "| fault | outcome | rows | succeeded | failed | rows lost | paid twice | batches | "
        "batch executions | realtime calls |\n|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(_TABLE[f.name] for f in FAULTS)
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
