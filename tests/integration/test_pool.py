"""The whole job on backend `vllm`: a pool of emulated vLLM servers, one stopped mid-run, and a
run killed midway and resumed; checked in the store and the engines' billing ledger."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from flows.enrich import enrich
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.vllm_pool import start_engines
from lowtide.store import Store
from tests.integration.conftest import lowtide_cli, write_job
from tests.sql import query
from tests.waiting import CountingLedger

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

MODEL = "qwen2.5-7b-instruct"  # the sample job's model id for backend vllm
POOL = "[pool]\ncheckpoint_every = 20\ngpu_hour_usd = 3.6\ngpus = 1\n"


def _answered(store: Store, run_id: str) -> set[str]:
    return set(
        query(
            store,
            "SELECT r.custom_id FROM results r JOIN batch_requests br ON br.custom_id = r.custom_id "
            "JOIN batches b ON b.batch_id = br.batch_id "
            "WHERE b.run_id = ? AND r.outcome IN ('ok', 'repaired')",
            [run_id],
        )["custom_id"]
    )


def test_pool_run_survives_an_engine_stopped_midway(tmp_path: Path, monkeypatch) -> None:
    job = write_job(tmp_path, rows=300, eval_rows=10, extra=POOL)
    ledger = CountingLedger(60)
    with start_engines(
        3, EngineConfig(time_scale=10.0), ledger=ledger, served_model_name=MODEL
    ) as pool:
        monkeypatch.setenv("LOWTIDE_VLLM_URLS", ",".join(pool.urls))
        stopped_midway = threading.Event()

        def stop_one() -> None:
            ledger.reached[60].wait()  # 60 executions, or the run's end (set below)
            if not run_ended.is_set():
                stopped_midway.set()
            pool.stop(1)

        run_ended = threading.Event()
        stopper = threading.Thread(target=stop_one)
        stopper.start()
        try:
            s = enrich(job_file=str(job), backend="vllm")
        finally:
            run_ended.set()
            ledger.reached[60].set()
            stopper.join()
        assert pool.is_stopped(1)
        assert stopped_midway.is_set(), "the run ended before 60 requests were executed"
    assert s["status"] == "completed"
    assert s["rows"] == 300 == s["succeeded"] + s["failed"]
    assert s["failed"] == 0
    counts = ledger.count_by_custom_id()
    assert len(counts) == s["unique_requests"]
    # The only request that may run twice is one the stopped server had executed while its
    # answer was still on the way: the crash resets the connection, the answer never arrives,
    # and sending it again is right. Anything answered by a live server ran once.
    servers_by_id: dict[str, list[str | None]] = {}
    for e in ledger.executions():
        servers_by_id.setdefault(e["custom_id"], []).append(e["server"])
    twice = {c: servers for c, servers in servers_by_id.items() if len(servers) > 1}
    for custom_id, servers in twice.items():
        assert len(servers) == 2 and servers[0] == "1" != servers[1], (
            f"{custom_id} was answered by servers {servers}: a request was answered twice"
        )
    # lost answers are of requests that finished as it stopped: at most one engine step's worth
    assert len(twice) <= EngineConfig().max_num_seqs, f"{len(twice)} requests sent twice"
    store = Store(os.environ["LOWTIDE_STATE"])
    cost = query(
        store, "SELECT cost_usd FROM costs WHERE run_id = ? AND level = 'run'", [s["run_id"]]
    )
    assert cost["cost_usd"][0] > 0  # priced by GPU time


def test_pool_run_killed_midway_resends_only_the_missing(tmp_path: Path) -> None:

    job = write_job(tmp_path, rows=200, eval_rows=10, extra=POOL)
    ledger = BillingLedger()
    with start_engines(
        2, EngineConfig(time_scale=10.0), ledger=ledger, served_model_name=MODEL
    ) as pool:
        env = {"LOWTIDE_VLLM_URLS": ",".join(pool.urls), "LOWTIDE_CRASH_AT": "during_stream"}
        crashed = lowtide_cli("run", str(job), "--backend", "vllm", cwd=tmp_path, env=env)
        assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
        store = Store(os.environ["LOWTIDE_STATE"])
        run_id = store.list_runs().row(0, named=True)["run_id"]
        kept = _answered(store, run_id)
        assert kept  # the first group of answers was committed before the kill
        before = ledger.count_by_custom_id()

        os.environ["LOWTIDE_VLLM_URLS"] = ",".join(pool.urls)
        try:
            s = enrich(job_file=str(job), backend="vllm")
        finally:
            del os.environ["LOWTIDE_VLLM_URLS"]
    assert s["run_id"] == run_id and s["status"] == "completed"
    assert s["rows"] == 200 == s["succeeded"] + s["failed"]
    after = ledger.count_by_custom_id()
    assert all(after[k] == before[k] for k in kept)  # nothing stored was sent again
    assert len(after) == s["unique_requests"]


def test_urgent_rows_on_the_pool_go_first(tmp_path: Path, monkeypatch) -> None:
    """A pool has no realtime path: urgent rows ([input] priority_column) are the first shard
    it streams, and the run completes (it used to plan a realtime batch the pool cannot send
    and stay `running` forever)."""
    import polars as pl

    job = write_job(
        tmp_path,
        rows=40,
        eval_rows=5,
        extra=POOL,
        replace={'text_column = "body"': 'text_column = "body"\npriority_column = "urgent"'},
    )
    messages = pl.read_csv(tmp_path / "messages.csv")
    # the urgent rows are the last ones, so input order alone would send them last
    urgent_rows = messages.tail(6)["message_id"]
    messages.with_columns(
        pl.col("message_id").is_in(urgent_rows.implode()).alias("urgent")
    ).write_csv(tmp_path / "messages.csv")
    ledger = BillingLedger()
    with start_engines(
        1, EngineConfig(time_scale=10.0), ledger=ledger, served_model_name=MODEL
    ) as pool:
        monkeypatch.setenv("LOWTIDE_VLLM_URLS", ",".join(pool.urls))
        s = enrich(job_file=str(job), backend="vllm")
    assert s["status"] == "completed"
    assert s["rows"] == 40 == s["succeeded"] + s["failed"]
    store = Store(os.environ["LOWTIDE_STATE"])
    batches = store.run_batches(s["run_id"])
    assert "realtime" not in batches["backend"].to_list()
    urgent_requests = set(
        query(
            store,
            "SELECT DISTINCT custom_id FROM units WHERE run_id = ? AND kind = 'row' "
            "AND list_contains(?, source_id)",
            [s["run_id"], urgent_rows.to_list()],
        )["custom_id"]
    )
    first_shard = set(
        query(
            store,
            "SELECT custom_id FROM batch_requests WHERE batch_id = ?",
            [batches.filter(pl.col("shard") == 0)["batch_id"][0]],
        )["custom_id"]
    )
    assert first_shard == urgent_requests
    executed = [e["custom_id"] for e in ledger.executions()]
    assert set(executed[: len(urgent_requests)]) == urgent_requests  # answered before the rest
    assert len(executed) == len(set(executed)) == s["unique_requests"]
