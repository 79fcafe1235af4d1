"""Backend `vllm-run-batch` end to end: a run planned with the real CLI, its requests exported as
run-batch shards, each shard run by the emulated `vllm run-batch` as its own process (one of
them killed midway), the outputs imported, the leftovers exported and run again, the run
finished and published. Every CLI call is a subprocess, as on an Indexed Job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import polars as pl
import pytest

from lowtide.backends.run_batch_shards import ShardFileError, read_output, shard_dir
from lowtide.backends.vllm_pool.run_batch import plan_shards
from tests.integration.conftest import lowtide_cli, write_job
from tests.sql import query, scalar

CRASH_AFTER = 4


def _run_batch(shard: Path, crash_after: int | None = None) -> subprocess.CompletedProcess[str]:
    """`vllm run-batch` for one shard, as its own process (the emulator's stand-in)."""
    model = orjson.loads(shard.read_bytes().splitlines()[0])["body"]["model"]
    out = shard.with_name(shard.name.replace("input-", "output-"))
    crash = ["--crash-after", str(crash_after)] if crash_after is not None else []
    return subprocess.run(
        [sys.executable, "-m", "lowtide.emulator.run_batch", "-i", str(shard), "-o", str(out)]
        + ["--model", model, *crash],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _ids(path: Path) -> list[str]:
    return [orjson.loads(line)["custom_id"] for line in path.read_bytes().splitlines()]


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _answered(state: str) -> pl.DataFrame:
    return query(
        state, "SELECT custom_id, batch_id FROM results WHERE outcome IN ('ok', 'repaired')"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)  # nine CLI processes and four run-batch ones, on a busy machine
@pytest.mark.usefixtures("prefect_harness")
def test_run_batch_shards_out_and_back_with_one_crashed_shard(tmp_path: Path) -> None:
    state = os.environ["LOWTIDE_STATE"]
    job = write_job(tmp_path, rows=24, eval_rows=4)
    _ok(lowtide_cli("run", str(job), "--backend", "vllm-run-batch", "--no-wait", cwd=tmp_path))
    run_id = scalar(state, "SELECT run_id FROM runs")
    assert scalar(state, "SELECT status FROM runs") == "submitted"
    planned = query(state, "SELECT custom_id FROM requests")["custom_id"].to_list()
    # lowtide cannot stop a Job it does not own: cancel refuses and leaves the run importable
    refused = lowtide_cli("cancel", run_id, cwd=tmp_path)
    assert refused.returncode == 2 and "delete the Job" in refused.stderr, refused.stderr
    assert scalar(state, "SELECT status FROM runs") == "submitted"

    first = tmp_path / "round-1"
    _ok(lowtide_cli("shards", "export", run_id, "--dir", str(first), "--shards", "3", cwd=tmp_path))
    inputs = sorted(first.glob("input-*.jsonl"))
    assert [p.name for p in inputs] == [f"input-{i:05d}.jsonl" for i in range(3)]
    shard_ids = [_ids(p) for p in inputs]
    assert sorted(sum(shard_ids, [])) == sorted(planned)  # every request in exactly one shard
    # the shards are recorded as batches: written-ahead rows, now handed to the Job
    batches = query(
        state,
        "SELECT shard, status, provider_batch_id FROM batches WHERE run_id = ? ORDER BY shard",
        [run_id],
    )
    assert batches["status"].to_list() == ["in_progress"] * 3
    assert batches["provider_batch_id"].to_list() == [
        f"runbatch:{shard_dir(str(first))}/input-{i:05d}.jsonl" for i in range(3)
    ]

    assert _run_batch(inputs[0]).returncode == 0
    crashed = _run_batch(inputs[1], crash_after=CRASH_AFTER)
    assert crashed.returncode == 137, crashed.stderr
    assert _run_batch(inputs[2]).returncode == 0
    partial = (first / "output-00001.jsonl").read_bytes()
    assert partial.count(b"\n") == CRASH_AFTER and not partial.endswith(b"\n")  # cut mid-line

    imported = _ok(lowtide_cli("shards", "import", run_id, "--dir", str(first), cwd=tmp_path))
    answered_once = shard_ids[0] + shard_ids[1][:CRASH_AFTER] + shard_ids[2]
    left = shard_ids[1][CRASH_AFTER:]
    assert sorted(_answered(state)["custom_id"]) == sorted(answered_once)
    assert f"{len(answered_once)} answers imported" in imported
    assert scalar(state, "SELECT status FROM runs") == "submitted"  # the leftovers are pending
    assert not scalar(
        state,
        "SELECT count(*) FROM results WHERE list_contains(?, custom_id)",
        [left],
    )

    # importing the same outputs again adds nothing, and says so
    again = _ok(lowtide_cli("shards", "import", run_id, cwd=tmp_path))
    assert "0 answers imported" in again and f"{CRASH_AFTER} lines already imported" in again
    assert sorted(_answered(state)["custom_id"]) == sorted(answered_once)

    # the next export (an fsspec URL this time) sends only what the crashed shard left
    second = tmp_path / "round-2"
    _ok(lowtide_cli("shards", "export", run_id, "--dir", second.as_uri(), cwd=tmp_path))
    (leftover,) = sorted(second.glob("input-*.jsonl"))
    assert sorted(_ids(leftover)) == sorted(left)
    assert _run_batch(leftover).returncode == 0

    done = _ok(lowtide_cli("shards", "import", run_id, cwd=tmp_path))
    assert f"{len(left)} answers imported" in done
    run = query(state, "SELECT status, rows, succeeded, failed FROM runs").row(0, named=True)
    assert run == {"status": "completed", "rows": 24, "succeeded": 24, "failed": 0}
    answers = _answered(state)
    assert sorted(answers["custom_id"]) == sorted(planned)  # every request answered, once
    crashed_batch = f"{run_id}-rb1-00001"
    assert answers.filter(pl.col("custom_id").is_in(left))["batch_id"].str.contains("-rb2-").all()
    assert scalar(state, "SELECT status FROM batches WHERE batch_id = ?", [crashed_batch]) == (
        "expired"
    )
    published = query(
        os.environ["LOWTIDE_DB"],
        "SELECT count(*) AS n, count(intent) AS answered FROM support_intents",
    ).row(0, named=True)
    assert published == {"n": 24, "answered": 24}
    nothing = lowtide_cli("shards", "import", run_id, cwd=tmp_path)
    assert nothing.returncode == 0 and "is completed: nothing to import" in nothing.stdout


def test_shards_of_an_unknown_run_is_a_one_line_error(tmp_path: Path) -> None:
    missing = lowtide_cli("shards", "export", "no-such-run", "--dir", str(tmp_path), cwd=tmp_path)
    assert missing.returncode == 2 and "no run 'no-such-run'" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_plan_shards_deals_every_request_once_within_the_limits() -> None:
    work = [5, 400, 30, 30, 1, 90, 90, 12, 7, 300]
    for options in (
        {"budget": 100.0},
        {"budget": 1e9, "max_requests": 3},
        {"shards": 4, "budget": 1.0},
    ):
        groups = plan_shards(work, **options)
        assert sorted(i for g in groups for i in g) == list(range(len(work)))
        assert all(groups)
    assert len(plan_shards(work, budget=100.0)) == 10  # ceil(965 / 100), at most one per request
    assert len(plan_shards(work, budget=1e9, max_requests=3)) == 4
    assert len(plan_shards(work, budget=1.0, shards=4)) == 4
    assert plan_shards([], budget=1.0) == []


def test_an_output_file_is_read_up_to_its_cut_off_line_and_a_bad_line_is_named() -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    ok = b'{"custom_id":"a","response":{"status_code":200,"body":null},"error":null}'
    fs.pipe("/shards/output-00000.jsonl", ok + b"\n" + ok.replace(b'"a"', b'"b"')[:20])
    got = read_output("memory:///shards/output-00000.jsonl")
    assert got is not None and got.lines == 1 and got.cut_off
    assert got.rows["custom_id"].to_list() == ["a"]
    assert read_output("memory:///shards/output-00009.jsonl") is None
    fs.pipe("/shards/output-00001.jsonl", ok + b"\nnot json\n")
    with pytest.raises(ShardFileError, match=r"output-00001\.jsonl: line 2 is not JSON"):
        read_output("memory:///shards/output-00001.jsonl")
