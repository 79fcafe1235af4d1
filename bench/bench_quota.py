"""The sample job in 100 shards against an OpenAI queue that holds three of them.

Two nights of `lowtide run --backend openai` (the official SDK over HTTP to lowtide's emulator,
each night in its own process, no Prefect server), against an emulator whose model has an
enqueued-token limit of three shards of the usual size (their median, from a plan written to a
scratch state file first), as a low usage tier's account has. The limit is not
in the job file: the first night must learn it from the provider's refusal, the second must
start with it. The second night asks the eval set again (it is answered every night) and the
messages it changes.

Printed per night: wall seconds, batches, quota refusals, rows failed; then what the provider
saw (`GET /_emulator/queue`): how full the queue was kept, over simulated time, while work
remained to be sent (the first create to the last), and with the final drain (to the last
batch's end: nothing is left to fill the queue with then). The emulator's ledger says whether
any request ran twice. The last line is machine-readable:

    quota: shards=100 queue_share=<first night, while sending> queue_share_with_drain=<…>
    refusals_first=N refusals_second=N paid_twice=0 rows_failed=0

    make bench-quota          # about ten minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
import httpx2
import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lowtide.emulator import Emulator, EmulatorConfig  # noqa: E402
from lowtide.quota import PLANNING_SHARE  # noqa: E402
from tests.integration.conftest import write_job  # noqa: E402

SHARDS = 100
QUEUE_SHARDS = 3  # the queue holds three shards of the usual size
TIME_SCALE = 600.0  # simulated seconds per real second
BATCH_S = 7200.0  # simulated seconds a shard runs (two hours): twelve real seconds


def _night(job: Path, env: dict[str, str], cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "lowtide.cli", "run", str(job), "--backend", "openai"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"lowtide run failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return time.perf_counter() - started


def _state(state: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(state), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _queue(emu: Emulator) -> dict:
    return httpx2.get(f"{emu.base_url}/_emulator/queue", timeout=30).json()["openai"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="first N messages (default all)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lowtide-bench-quota-"))
    job = write_job(work, rows=args.rows, eval_rows=200)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWTIDE_", "PREFECT_API_URL"))}
    env |= {
        "LOWTIDE_STATE": str(work / "state.duckdb"),
        "LOWTIDE_DB": str(work / "lowtide.duckdb"),
        "LOWTIDE_WORK_DIR": str(work / "work"),
        "LOWTIDE_POLL_MAX_INTERVAL_S": "0.5",
        "OPENAI_API_KEY": "bench",
    }
    requests, per_shard, tokens_per_shard = _shards(job, env, work)
    # three shards of the usual size fit: the queue lowtide plans to (PLANNING_SHARE of it)
    limit = int(tokens_per_shard * QUEUE_SHARDS / PLANNING_SHARE) + 1
    config = EmulatorConfig(
        time_scale=TIME_SCALE,
        seed=3,
        error_rate=0.0,
        enqueued_token_limit=limit,
        batch_seconds_per_request=BATCH_S / per_shard,
    )
    print(
        f"quota bench: {requests:,} requests in shards of {per_shard} (median "
        f"{tokens_per_shard:,.0f} tokens) against a queue of {limit:,} enqueued tokens; a shard runs {BATCH_S:.0f} "
        f"simulated s ({BATCH_S / TIME_SCALE:.0f} s)"
    )
    with Emulator(config) as emu:
        env |= {
            "OPENAI_BASE_URL": emu.openai_base_url,
            "LOWTIDE_SHARD_MAX_REQUESTS": str(per_shard),
        }
        state = work / "state.duckdb"
        shares = []
        refusals = []
        for night in (1, 2):
            httpx2.post(f"{emu.base_url}/_emulator/queue/reset", timeout=30)
            wall = _night(job, env, work)
            run_id, batches, failed = _state(
                state,
                "SELECT r.run_id, (SELECT count(*) FROM batches b WHERE b.run_id = r.run_id), "
                "r.failed FROM runs r ORDER BY started_at DESC LIMIT 1",
            )[0]
            refused = _state(
                state, f"SELECT count(*) FROM quota_refusals WHERE run_id = '{run_id}'"
            )[0][0]
            queue = next(iter(_queue(emu).values()), {})
            shares.append((queue.get("share_while_sending"), queue.get("share")))
            refusals.append(refused)
            print(
                f"night {night}: {wall:.1f} s, {batches} batches, {refused} refused, "
                f"{failed} rows failed; queue {queue.get('share_while_sending') or 0:.3f} full "
                f"while batches were still being sent ({queue.get('sending_s', 0):,.0f} simulated "
                f"s), {queue.get('share') or 0:.3f} with the drain ({queue.get('busy_s', 0):,.0f} s)"
            )
            if night == 1:
                _change(work / "messages.csv", 0.01)
        executed = emu.ledger.count_by_custom_id()
        paid_twice = sum(n - 1 for n in executed.values() if n > 1)
        failed_rows = sum(r[0] for r in _state(state, "SELECT failed FROM runs"))
    print(
        f"quota: shards={SHARDS} queue_share={shares[0][0] or 0:.3f} "
        f"queue_share_with_drain={shares[0][1] or 0:.3f} refusals_first={refusals[0]} "
        f"refusals_second={refusals[1]} paid_twice={paid_twice} rows_failed={failed_rows}"
    )


def _shards(job: Path, env: dict[str, str], work: Path) -> tuple[int, int, float]:
    """(requests, requests per shard, the median shard's estimated prompt tokens), from the
    plan of a first night written to a scratch state file against an unlimited emulator (it
    stops once the first batch is sent)."""
    scratch = work / "plan"
    scratch.mkdir()
    with Emulator(EmulatorConfig(time_scale=TIME_SCALE, seed=3)) as emu:
        plan_env = env | {
            "OPENAI_BASE_URL": emu.openai_base_url,
            "LOWTIDE_STATE": str(scratch / "state.duckdb"),
            "LOWTIDE_DB": str(scratch / "lowtide.duckdb"),
            "LOWTIDE_WORK_DIR": str(scratch / "work"),
        }
        requests = int(
            _run_json(job, plan_env, scratch, ["estimate", str(job), "--json"])["unique_requests"]
        )
        per_shard = -(-requests // SHARDS)
        plan_env["LOWTIDE_SHARD_MAX_REQUESTS"] = str(per_shard)
        subprocess.run(
            [sys.executable, "-m", "lowtide.cli", "run", str(job), "--no-wait"],
            env=plan_env | {"LOWTIDE_EMULATOR_URL": emu.base_url},
            cwd=scratch,
            capture_output=True,
            check=True,
        )
    median = _state(
        scratch / "state.duckdb", "SELECT median(est_tokens) FROM batches WHERE attempt = 1"
    )[0][0]
    return requests, per_shard, float(median)


def _run_json(job: Path, env: dict[str, str], cwd: Path, args: list[str]) -> dict:
    import orjson

    done = subprocess.run(
        [sys.executable, "-m", "lowtide.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return orjson.loads(done.stdout)


def _change(path: Path, share: float) -> None:
    """The next night's input: the first `share` of the messages changed."""
    messages = pl.read_csv(path)
    changed = pl.int_range(pl.len()) < int(messages.height * share)
    messages.with_columns(
        pl.when(changed).then(pl.col("body") + " (sent again)").otherwise(pl.col("body"))
    ).write_csv(path)


if __name__ == "__main__":
    main()
