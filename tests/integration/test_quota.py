"""A provider's queue smaller than the job: the run plans around it, learns its limit from the
provider's own refusal, remembers it for the next night, and never pays twice while waiting.

The emulator refuses an OpenAI batch at validation when it would push the model's enqueued
prompt tokens past `enqueued_token_limit`, as OpenAI does (not a 429): its ledger is the
provider's bill.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import polars as pl
import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.limits import queue_report
from tests.integration.conftest import lowtide_cli, write_job
from tests.reliability_doc import write_section
from tests.sql import query, scalar

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

RESULTS: dict[str, dict] = {}
"""Each case's outcome, for the table in docs/reliability.md (written by the last test)."""

ROWS = 150
SHARD = 30  # requests per batch: ~24,000 estimated prompt tokens each for the sample job
QUEUE = 77_000  # enqueued tokens: room for three such batches, not four


def _env(emu: Emulator, tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "OPENAI_BASE_URL": emu.openai_base_url,
        "OPENAI_API_KEY": "x",
        "LOWTIDE_SHARD_MAX_REQUESTS": str(SHARD),
        "LOWTIDE_POLL_MAX_INTERVAL_S": "0.5",
        **extra,
    }


def _change_rows(tmp_path: Path, n: int) -> None:
    """The next night's input: the first `n` messages changed."""
    path = tmp_path / "messages.csv"
    messages = pl.read_csv(path)
    changed = pl.int_range(pl.len()) < n
    messages.with_columns(
        pl.when(changed).then(pl.col("body") + " (sent again)").otherwise(pl.col("body"))
    ).write_csv(path)


def _refusals(run_id: str) -> int:
    return int(
        scalar(
            os.environ["LOWTIDE_STATE"],
            "SELECT count(*) FROM quota_refusals WHERE run_id = ?",
            [run_id],
        )
    )


def _record(case: str, provider: str, emu: Emulator, runs: list[dict]) -> None:
    """One row of the reliability table: what the provider's ledger and the state file say."""
    executed = emu.ledger.count_by_custom_id()
    RESULTS[case] = {
        "provider": provider,
        "nights": len(runs),
        "refusals": " / ".join(str(_refusals(r["run_id"])) for r in runs),
        "rows": sum(r["rows"] for r in runs),
        "lost": sum(r["rows"] - r["succeeded"] - r["failed"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "paid_twice": sum(n - 1 for n in executed.values() if n > 1),
    }


def _last_run() -> dict:
    return query(
        os.environ["LOWTIDE_STATE"], "SELECT * FROM runs ORDER BY started_at DESC LIMIT 1"
    ).row(0, named=True)


def test_a_queue_smaller_than_the_job_is_learned_once_and_remembered(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=ROWS, eval_rows=10)
    # batches run long enough (50 simulated minutes) for the queue to fill before one ends
    config = EmulatorConfig(
        time_scale=600.0,
        seed=3,
        error_rate=0.0,
        enqueued_token_limit=QUEUE,
        batch_seconds_per_request=100.0,
    )
    with Emulator(config) as emu:
        env = _env(emu, tmp_path)
        first = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env)
        assert first.returncode == 0, first.stdout + first.stderr
        night1 = _last_run()
        assert night1["status"] == "completed"
        assert night1["succeeded"] == ROWS and night1["failed"] == 0
        # the limit was unknown: one batch waited for admission at a time, so the provider
        # refused at most one batch before its refusal taught the limit
        assert _refusals(night1["run_id"]) <= 1
        learned = query(
            os.environ["LOWTIDE_STATE"],
            "SELECT value, source FROM provider_limits WHERE name = 'enqueued_tokens'",
        )
        if _refusals(night1["run_id"]):
            assert learned.row(0) == (QUEUE, "refusal")

        _change_rows(tmp_path, 60)
        second = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env)
        assert second.returncode == 0, second.stdout + second.stderr
        night2 = _last_run()
        assert night2["run_id"] != night1["run_id"] and night2["requests_sent"] > SHARD
        assert _refusals(night2["run_id"]) == 0  # the limit was remembered
        assert night2["succeeded"] == ROWS

        # the provider's bill: every request executed once, refused batches ran nothing
        executed = emu.ledger.count_by_custom_id()
        assert set(executed.values()) == {1}
        sent = scalar(
            os.environ["LOWTIDE_STATE"],
            "SELECT count(DISTINCT br.custom_id) FROM batch_requests br JOIN batches b "
            "USING (batch_id) WHERE b.provider_batch_id IS NOT NULL",
        )
        assert len(executed) == sent
        refused = [b for b in emu.state.batches.values() if b.status == "failed"]
        assert all(b.executed == 0 for b in refused)
        _record(
            "OpenAI queue of 3 batches, limit unknown, two nights", "openai", emu, [night1, night2]
        )


def test_a_batch_larger_than_the_queue_is_cut_to_fit(tmp_path: Path) -> None:
    """Shards of 60 requests (~48,000 tokens) against a queue of 40,000: the refusal states the
    limit, the batch is cut, and every row is answered once."""
    job = write_job(tmp_path, rows=90, eval_rows=5)
    config = EmulatorConfig(time_scale=600.0, seed=3, error_rate=0.0, enqueued_token_limit=40_000)
    with Emulator(config) as emu:
        env = _env(emu, tmp_path, LOWTIDE_SHARD_MAX_REQUESTS="60")
        done = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        run = _last_run()
        assert run["succeeded"] == 90 and run["failed"] == 0
        pieces = scalar(
            os.environ["LOWTIDE_STATE"],
            "SELECT count(*) FROM batches WHERE batch_id LIKE '%-p%' AND run_id = ?",
            [run["run_id"]],
        )
        assert pieces >= 2
        assert set(emu.ledger.count_by_custom_id().values()) == {1}
        _record("a batch larger than the whole queue", "openai", emu, [run])


def test_configured_limits_need_no_refusal(tmp_path: Path) -> None:
    """`[limits.openai] enqueued_tokens` known up front: no batch is ever refused."""
    extra = f"\n[limits.openai]\nenqueued_tokens = {QUEUE}\n"
    job = write_job(tmp_path, rows=ROWS, eval_rows=10, extra=extra)
    config = EmulatorConfig(time_scale=600.0, seed=3, error_rate=0.0, enqueued_token_limit=QUEUE)
    with Emulator(config) as emu:
        done = lowtide_cli(
            "run", str(job), "--backend", "openai", cwd=tmp_path, env=_env(emu, tmp_path)
        )
        assert done.returncode == 0, done.stdout + done.stderr
        run = _last_run()
        assert _refusals(run["run_id"]) == 0 and run["succeeded"] == ROWS
        assert not [b for b in emu.state.batches.values() if b.status == "failed"]
        _record("limit stated in [limits.openai]", "openai", emu, [run])


def test_a_kill_while_waiting_for_room_resumes_without_paying_twice(tmp_path: Path) -> None:
    """The clock stands still until the kill, so the first batch is never admitted and the
    next waits for it: the kill comes on that event, not on a race with the machine."""
    job = write_job(tmp_path, rows=ROWS, eval_rows=10)
    config = EmulatorConfig(time_scale=0.0, seed=3, error_rate=0.0, enqueued_token_limit=QUEUE)
    with Emulator(config) as emu:
        env = _env(emu, tmp_path, LOWTIDE_CRASH_AT="waiting_for_room")
        crashed = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env)
        assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
        crashed_run = _last_run()
        emu.state.clock.set_time_scale(600.0)
        resumed = lowtide_cli(
            "run", str(job), "--backend", "openai", cwd=tmp_path, env=_env(emu, tmp_path)
        )
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        run = _last_run()
        assert run["run_id"] == crashed_run["run_id"]  # resumed, not started over
        assert run["succeeded"] == ROWS
        assert set(emu.ledger.count_by_custom_id().values()) == {1}
        _record("SIGKILL while waiting for room, then resumed", "openai", emu, [run])


def test_anthropic_queue_full_waits_for_room_and_learns_its_size(tmp_path: Path) -> None:
    """Anthropic's queue (requests waiting, all models) holds two of the run's batches, and its
    batches take minutes: a full queue is a 429 with `retry-after`, which the run waits out,
    remembering what the queue held, and nothing is paid twice."""
    job = write_job(tmp_path, rows=ROWS, eval_rows=10)
    config = EmulatorConfig(
        time_scale=600.0,
        seed=3,
        error_rate=0.0,
        batch_seconds_per_request=60.0,  # a 30-request batch runs half a simulated hour
        anthropic_queue_limit=2 * SHARD + 5,
    )
    with Emulator(config) as emu:
        env = {
            "ANTHROPIC_BASE_URL": emu.anthropic_base_url,
            "ANTHROPIC_API_KEY": "x",
            "LOWTIDE_SHARD_MAX_REQUESTS": str(SHARD),
            "LOWTIDE_POLL_MAX_INTERVAL_S": "0.5",
        }
        done = lowtide_cli("run", str(job), "--backend", "anthropic", cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        run = _last_run()
        assert run["succeeded"] == ROWS and run["failed"] == 0
        assert _refusals(run["run_id"]) == 0  # a 429 on create made no batch to refuse
        learned = query(
            os.environ["LOWTIDE_STATE"],
            "SELECT value FROM provider_limits WHERE provider = 'anthropic' "
            "AND name = 'queued_requests'",
        )
        assert learned.rows() == [(2 * SHARD + 5,)]  # as the 429 stated it
        assert set(emu.ledger.count_by_custom_id().values()) == {1}
        with emu.state.lock:
            report = queue_report(emu.state, emu.state.tick())
        assert report["anthropic"]["*"]["refusals"] >= 1
        _record("Anthropic queue of 2 batches (429, retry-after)", "anthropic", emu, [run])


def test_batches_still_waiting_at_the_deadline_take_the_stragglers_path(tmp_path: Path) -> None:
    """A queue that holds one batch, batches that run a simulated hour, and a deadline of under
    a second: the batches still waiting for room end expired at the deadline and their requests
    go through the realtime path; every row is answered, none twice."""
    extra = "\n[limits.openai]\nenqueued_tokens = 30000\n"
    job = write_job(
        tmp_path,
        rows=90,
        eval_rows=5,
        extra=extra,
        replace={"[cost]": "[retry]\ndeadline_hours = 0.0002\n\n[cost]"},
    )
    config = EmulatorConfig(
        time_scale=600.0, seed=3, error_rate=0.0, batch_seconds_per_request=120.0
    )
    with Emulator(config) as emu:
        done = lowtide_cli(
            "run", str(job), "--backend", "openai", cwd=tmp_path, env=_env(emu, tmp_path)
        )
        assert done.returncode == 0, done.stdout + done.stderr
        run = _last_run()
        assert run["succeeded"] == 90
        expired = scalar(
            os.environ["LOWTIDE_STATE"],
            "SELECT count(*) FROM batches WHERE run_id = ? AND status = 'expired' "
            "AND errors LIKE '%queue_full%'",
            [run["run_id"]],
        )
        assert expired >= 1
        realtime = scalar(
            os.environ["LOWTIDE_STATE"],
            "SELECT count(*) FROM results WHERE run_id = ? AND channel = 'realtime'",
            [run["run_id"]],
        )
        assert realtime >= SHARD
        assert set(emu.ledger.count_by_custom_id().values()) == {1}
        _record("deadline passed while batches waited for room", "openai", emu, [run])


def test_write_the_quota_table() -> None:
    """Runs after the cases (file order): the table in docs/reliability.md."""
    if len(RESULTS) < 6:
        pytest.skip("the cases did not all run in this session")
    lines = [
        "The sample job against an emulated provider whose queue is smaller than the job "
        "(`tests/integration/test_quota.py`); `refused` counts batches the provider refused for "
        "its quota, per night; `paid twice` is from the emulator's billing ledger.",
        "",
        "| case | provider | nights | refused | rows | rows lost | rows failed | paid twice |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, r in RESULTS.items():
        lines.append(
            f"| {case} | {r['provider']} | {r['nights']} | {r['refusals']} | {r['rows']} | "
            f"{r['lost']} | {r['failed']} | {r['paid_twice']} |"
        )
    write_section("quota", "Provider queues", "\n".join(lines))
