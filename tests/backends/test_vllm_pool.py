"""The vLLM pool client over real HTTP to emulated vLLM engines on loopback.

Engines run compressed time (`time_scale`), the pool polls and probes fast (`FAST`), and every
check of "exactly once" uses the emulator's billing ledger: the server records an execution
only when it has produced the answer. Nothing here asserts on wall-clock time: what is checked
are counts, the order of events and what the servers saw. The pool's own timeouts are set far
above what a busy 2-core host needs (engines and pool share one process and its GIL), except
where a timeout is the thing under test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import httpx
import jsonschema
import orjson
import polars as pl
import pytest
from fastapi import FastAPI
from fastapi.responses import Response

from lowtide.backends.base import RESULT_SCHEMA, TerminalBackendError, TransientBackendError
from lowtide.backends.openai_batch import parse_result_lines
from lowtide.backends.vllm_pool import (
    ENV_API_KEY,
    ENV_URLS,
    EngineLoad,
    PoolConfig,
    PoolConfigError,
    assign_groups,
    next_cap,
    parse_metrics,
    prefix_key,
    run_batch_results,
    run_pool,
    runner,
    send_order,
    write_run_batch_shards,
)
from lowtide.backends.vllm_pool.control import backoff_delay, request_weights
from lowtide.backends.vllm_pool.runner import HEALTH_FAILURES_TO_DOWN
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.server import run_in_thread
from lowtide.emulator.vllm import create_vllm_app, render_metrics
from lowtide.emulator.vllm_pool import EnginePool, start_engines
from lowtide.jobspec import PoolSpec
from lowtide.tokens import count_tokens

MODEL = "emulated-model"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["card_arrival", "lost_card", "exchange_rate"]},
        "summary": {"type": "string", "maxLength": 40},
        "urgent": {"type": "boolean"},
    },
    "required": ["label", "summary", "urgent"],
    "additionalProperties": False,
}
SYSTEM = "You triage customer messages for a bank and answer with one JSON object. " * 6
FAST = {
    "metrics_interval_s": 0.1,
    "health_interval_s": 0.2,
    # /health and /metrics answer in milliseconds; a healthy engine must never look down
    # (a down engine's in-flight requests are sent again, and the ledger would show it).
    "connect_timeout_s": 10.0,
    "backoff_s": 0.05,
    "backoff_max_s": 0.2,
    "give_up_after_s": 20.0,
}


def make_line(
    custom_id: str,
    user: str,
    *,
    model: str = MODEL,
    max_tokens: int = 64,
    url: str = "/v1/chat/completions",
) -> str:
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "ticket", "strict": True, "schema": SCHEMA},
        },
    }
    line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return orjson.dumps(line).decode()


def make_requests(n: int, *, prefix: str = "req", words: int = 12) -> pl.DataFrame:
    ids = [f"{prefix}-{i:05d}" for i in range(n)]
    users = [
        f"Ticket {i}: my card has not arrived. " + " ".join(f"w{i}x{k}" for k in range(words))
        for i in range(n)
    ]
    return pl.DataFrame(
        {"custom_id": ids, "line": [make_line(c, u) for c, u in zip(ids, users, strict=True)]}
    )


def config(urls: list[str], **overrides: Any) -> PoolConfig:
    return PoolConfig(urls=tuple(urls), **{**FAST, **overrides})


class Collector:
    """A checkpoint that keeps every frame it is handed (called from the pool's writer thread)."""

    def __init__(self) -> None:
        self.frames: list[pl.DataFrame] = []
        self.rows = 0
        self.lock = threading.Lock()
        self.reached = threading.Event()
        self.threshold: int | None = None

    def __call__(self, frame: pl.DataFrame) -> None:
        with self.lock:
            self.frames.append(frame)
            self.rows += frame.height
            if self.threshold is not None and self.rows >= self.threshold:
                self.reached.set()

    @property
    def results(self) -> pl.DataFrame:
        return pl.concat(self.frames) if self.frames else pl.DataFrame(schema=RESULT_SCHEMA)


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_loaded() -> None:
    """The emulated model counts tokens; loading the vocabulary holds the GIL for seconds on
    a busy host, so it is done before any pool runs rather than inside the first one."""
    count_tokens("warm up")


@pytest.fixture
def engines() -> Iterator[Any]:
    pools: list[EnginePool] = []

    def start(n: int, config: EngineConfig | None = None, **kw: Any) -> EnginePool:
        pool = start_engines(n, config or EngineConfig(time_scale=20.0), **kw)
        pools.append(pool)
        return pool

    yield start
    for pool in pools:
        pool.close()


# -- configuration -------------------------------------------------------------------------------


def test_urls_from_the_environment_win_over_the_job_file():
    spec = PoolSpec(urls=["http://job-a:8000/v1"], max_inflight=64, bucketing=False)
    from_job = PoolConfig.from_spec(spec, env_urls=None)
    assert from_job.urls == ("http://job-a:8000/v1",)
    assert from_job.max_inflight == 64 and from_job.bucketing is False
    from_env = PoolConfig.from_spec(spec, env_urls=" http://env-a:8000 , http://env-b:8000/v1/ ,")
    assert from_env.urls == ("http://env-a:8000/v1", "http://env-b:8000/v1")
    assert PoolConfig.from_spec(spec, env_urls="  ").urls == ("http://job-a:8000/v1",)


def test_api_key_from_the_environment_wins_and_is_never_printed():
    spec = PoolSpec(urls=["http://a:8000/v1"], api_key="from-job-file")
    assert PoolConfig.from_spec(spec).api_key == "from-job-file"
    config = PoolConfig.from_spec(spec, env_api_key="from-env")
    assert config.api_key == "from-env"
    assert "from-env" not in repr(config) and "from-env" not in str(config)


def test_no_urls_names_both_places():
    with pytest.raises(PoolConfigError) as err:
        PoolConfig.from_spec(PoolSpec(), env_urls=None)
    message = str(err.value)
    assert ENV_URLS in message and "[pool] urls" in message
    with pytest.raises(PoolConfigError, match="not an http"):
        PoolConfig(urls=("host:8000",))
    with pytest.raises(PoolConfigError, match="listed twice"):
        PoolConfig(urls=("http://a:1/v1", "http://a:1"))
    with pytest.raises(PoolConfigError, match="min_inflight"):
        PoolConfig(urls=("http://a:1",), min_inflight=10, max_inflight=5)


# -- pure parts ----------------------------------------------------------------------------------


def load(running: float, waiting: float, kv: float | None = 0.1) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting, kv_usage=kv)


@pytest.mark.parametrize(
    ("cap", "now", "before", "slow", "expected"),
    [
        # idle engine holding all we sent: doubles in slow start, x1.125 (at least +1) after
        (8, load(8, 0), None, True, (16, True)),
        (64, load(64, 0), None, False, (72, False)),
        (4, load(4, 0), None, False, (5, False)),
        # a small queue (up to headroom = max(2, 10% of running)) still grows
        (70, load(64, 6), None, False, (78.75, False)),
        # too much waiting once: hold (a burst of long prefills looks like this)
        (16, load(1, 15), None, True, (16, True)),
        # twice: shrink by the smaller excess, leave slow start
        (100, load(64, 36), load(64, 30), True, (76.4, False)),
        # ... never below running + headroom
        (80, load(64, 50), load(64, 50), False, (70.4, False)),
        # ... nor by more than half
        (200, load(10, 190), load(10, 190), False, (100, False)),
        # KV nearly full: hold
        (64, load(64, 0, kv=0.95), None, False, (64, False)),
        # what we sent is not at the server yet (in transit, being tokenized): hold
        (64, load(20, 0), None, True, (64, True)),
        # bounds
        (200, load(200, 0), None, True, (256, True)),
        (2, load(0, 9), load(0, 9), False, (2, False)),
    ],
)
def test_next_cap(cap, now, before, slow, expected):
    new, still_slow = next_cap(cap, now, lo=2, hi=256, slow_start=slow, previous=before)
    assert (round(new, 3), still_slow) == expected


def test_parse_metrics_reads_vllm_gauges():
    engine_text = render_metrics(
        create_vllm_app(EngineConfig()).state.engine.stats(), 'engine="0",model_name="m"'
    )
    assert parse_metrics(engine_text) == EngineLoad(0.0, 0.0, 0.0)
    text = (
        "# HELP vllm:num_requests_running x\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 30.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 12.0 1700000000000\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        'vllm:gpu_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="1"} 0.75\n'
        "vllm:num_requests_waiting_by_reason 99\n"
    )
    assert parse_metrics(text) == EngineLoad(42.0, 4.0, 0.75)
    assert parse_metrics("# nothing from vLLM\nprocess_cpu_seconds_total 3.0\n") is None


def test_send_order_is_longest_first_and_stable():
    assert send_order([5, 9, 5, 1, 9], bucketing=True) == [1, 4, 0, 2, 3]
    assert send_order([5, 9, 5, 1, 9], bucketing=False) == [0, 1, 2, 3, 4]


def test_prefix_key_ignores_the_tail_of_the_last_user_message():
    head = "Account notes for customer 7: " + "likes cards " * 30
    a = orjson.loads(make_line("a", head + "message one"))["body"]
    b = orjson.loads(make_line("b", head + "another message"))["body"]
    c = orjson.loads(make_line("c", "Account notes for customer 8: " + "x " * 200))["body"]
    assert prefix_key(a, 256) == prefix_key(b, 256) != prefix_key(c, 256)
    other_model = orjson.loads(make_line("d", head + "x", model="other"))["body"]
    assert prefix_key(other_model, 256) != prefix_key(a, 256)


def test_assign_groups_keeps_groups_whole_and_balances_load():
    keys = [f"g{i % 12}" for i in range(120)]  # 12 groups of 10 (scattered in input order)
    weights = [100] * 120
    owned = assign_groups(keys, weights, 3, bucketing=True)
    assert sorted(i for part in owned for i in part) == list(range(120))
    homes = {}
    for e, part in enumerate(owned):
        for i in part:
            assert homes.setdefault(keys[i], e) == e  # every group on one endpoint
    assert [len(p) for p in owned] == [40, 40, 40]
    # a group heavier than a quarter of an endpoint's share is cut (here: everything one group)
    owned = assign_groups(["same"] * 120, weights, 3, bucketing=True)
    assert all(len(part) >= 30 for part in owned)
    # bucketing: an endpoint sends its pieces longest first
    weights = [i for i in range(120)]
    for part in assign_groups([str(i) for i in range(120)], weights, 3, bucketing=True):
        assert [weights[i] for i in part] == sorted((weights[i] for i in part), reverse=True)


# -- over HTTP -----------------------------------------------------------------------------------


def test_every_request_answered_once_with_schema_valid_answers(engines):
    ledger = BillingLedger()
    pool = engines(3, ledger=ledger)
    requests = make_requests(400)
    collect = Collector()
    stats = run_pool(requests, config(pool.urls, checkpoint_every=64), collect)

    assert [f.height for f in collect.frames] == [64] * 6 + [16]
    assert stats.checkpoints == 7
    results = collect.results
    assert dict(results.schema) == RESULT_SCHEMA
    assert sorted(results["custom_id"].to_list()) == requests["custom_id"].to_list()
    assert set(results["status"]) == {"answered"}
    for text in results["raw_text"]:
        jsonschema.validate(orjson.loads(text), SCHEMA)
    assert set(results["finish_reason"]) == {"stop"}
    assert results["input_tokens"].min() > 0 and results["output_tokens"].min() > 0
    # the emulator ran every request exactly once
    assert ledger.count_by_custom_id() == dict.fromkeys(requests["custom_id"], 1)
    assert (stats.requests, stats.answered, stats.errors, stats.failovers) == (400, 400, 0, 0)
    assert stats.output_tokens == results["output_tokens"].sum()
    assert stats.prompt_tokens == results["input_tokens"].sum()
    assert sum(e.sent for e in stats.per_endpoint.values()) == 400
    assert all(e.answered > 50 for e in stats.per_endpoint.values())
    assert stats.mean_inflight > 0 and stats.output_tokens_per_s > 0
    assert stats.gpu_cost_usd(3600.0, 2) == pytest.approx(stats.wall_s * 2)


def test_an_engine_stopped_mid_run_fails_over_and_loses_nothing(engines):
    ledger = BillingLedger()
    pool = engines(3, EngineConfig(time_scale=10.0), ledger=ledger)
    requests = make_requests(600)
    collect = Collector()
    collect.threshold = 150

    def crash_one() -> None:
        collect.reached.wait(timeout=30)
        pool.stop(1)

    crasher = threading.Thread(target=crash_one)
    crasher.start()
    stats = run_pool(requests, config(pool.urls, checkpoint_every=25), collect)
    crasher.join()

    assert pool.is_stopped(1)
    results = collect.results
    ids = results["custom_id"].to_list()
    assert len(ids) == len(set(ids)) == 600  # every request exactly once
    assert stats.answered + stats.errors == 600 == results.height  # rows = succeeded + failed
    assert set(results["status"]) == {"answered"}
    assert stats.failovers >= 1
    dead = stats.per_endpoint[pool.urls[1]]
    assert dead.failovers == 1
    executions = ledger.count_by_custom_id()
    assert set(executions) == set(requests["custom_id"])
    # A request runs twice only if the dead engine finished it but its answer never arrived;
    # such requests are the ones the pool re-sent after a send without an answer.
    twice = {cid for cid, n in executions.items() if n > 1}
    assert twice <= set(stats.resent)
    assert max(executions.values()) <= 2


class HealthWatch:
    """ASGI wrapper that counts a server's /health answers by status (what the pool was told);
    `refused` is set by the `refusals`-th 503."""

    def __init__(self, app: Any, refusals: int = 1) -> None:
        self.app = app
        self.refusals = refusals
        self.answers: Counter[int] = Counter()
        self.refused = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/health":
            await self.app(scope, receive, send)
            return

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.answers[message["status"]] += 1
                if self.answers[503] >= self.refusals:
                    self.refused.set()
            await send(message)

        await self.app(scope, receive, counted)


@pytest.mark.parametrize("refusals", [1, HEALTH_FAILURES_TO_DOWN])
def test_an_unhealthy_engine_is_taken_out_and_comes_back(engines, refusals: int):
    """Engine 0 is killed (its /health answers 503, requests 500) and revived as soon as the
    pool has been told 503 `refusals` times; engine 1 has two slots, so most of the run is left
    by then. One refusal is a hiccup, not a dead server: the engine stays in (taking it out
    would re-queue its in-flight requests, which then run twice); two take it out until
    /health answers 200 again. Either way every request is executed exactly once."""
    ledger = BillingLedger()
    app = create_vllm_app(EngineConfig(time_scale=5.0), ledger=ledger)
    watch = HealthWatch(app, refusals)
    first = run_in_thread(watch)
    second = engines(1, EngineConfig(max_num_seqs=2, time_scale=5.0), ledger=ledger)
    urls = [first.base_url + "/v1", second.urls[0]]
    engine_0, engine_1 = app.state.engine, second.engines[0]
    requests = make_requests(400)
    collect = Collector()
    collect.threshold = 60
    admin = first.base_url + "/_emulator"
    at_revival: list[tuple[int, int]] = []

    def served(engine: Any) -> int:
        return sum(engine.stats().request_success.values())

    def kill_and_revive() -> None:
        collect.reached.wait(timeout=120)  # guards against a hang only
        httpx.post(admin + "/kill", timeout=30)
        watch.refused.wait(timeout=120)  # the pool probed: it takes the engine out
        at_revival.append((served(engine_0), served(engine_1)))
        httpx.post(admin + "/revive", timeout=30)

    worker = threading.Thread(target=kill_and_revive)
    worker.start()
    try:
        # attempts are not what is tested: a request may meet the dead engine a few times
        # before the probe's answer takes it out
        stats = run_pool(requests, config(urls, checkpoint_every=20, max_attempts=50), collect)
    finally:
        worker.join()
        first.stop()

    results = collect.results
    assert results.height == 400 and results["custom_id"].n_unique() == 400
    assert set(results["status"]) == {"answered"}
    assert ledger.count_by_custom_id() == dict.fromkeys(requests["custom_id"], 1)
    if refusals < HEALTH_FAILURES_TO_DOWN:
        assert stats.per_endpoint[urls[0]].failovers == 0
        return
    assert stats.per_endpoint[urls[0]].failovers == 1
    assert watch.answers[503] >= refusals and watch.answers[200] >= 2  # up, down, up again
    # back in the pool once /health answered 200: it served most of what was left, more than
    # the two-slot engine did over the same stretch
    ((at_0, at_1),) = at_revival
    after_0, after_1 = served(engine_0) - at_0, served(engine_1) - at_1
    assert after_0 > after_1, (after_0, after_1)


@pytest.fixture
def wedged_server() -> Iterator[dict[str, Any]]:
    """A server whose engine hangs: chat requests never answer, and once `hung` is set, neither
    do /health and /metrics (a process stuck rather than dead: no connection is refused)."""
    state: dict[str, Any] = {"hung": False, "chats": 0}
    app = FastAPI()

    async def maybe_hang() -> None:
        while state["hung"]:
            await asyncio.sleep(0.05)

    @app.get("/health")
    async def health() -> Response:
        await maybe_hang()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        await maybe_hang()
        return Response("vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n")

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        state["chats"] += 1
        state["hung"] = True
        await asyncio.sleep(3600)
        return Response(status_code=500)

    server = run_in_thread(app)
    state["url"] = server.base_url + "/v1"
    yield state
    state["hung"] = False
    server.stop()


def test_a_hung_endpoint_is_taken_out_and_its_requests_reclaimed(engines, wedged_server):
    ledger = BillingLedger()
    pool = engines(1, ledger=ledger)
    urls = [wedged_server["url"], pool.urls[0]]
    requests = make_requests(100)
    collect = Collector()
    # the timeout under test: /metrics and /health that hang for this long mean "down"
    hung = config(urls, prefix_grouping=False, request_timeout_s=60, connect_timeout_s=2.0)
    stats = run_pool(requests, hung, collect)
    assert wedged_server["chats"] >= 1
    wedged = stats.per_endpoint[urls[0]]
    assert wedged.failovers == 1 and wedged.requeued == wedged.sent == wedged_server["chats"]
    assert wedged.answered == 0
    results = collect.results
    assert results.height == 100 and results["custom_id"].n_unique() == 100
    assert set(results["status"]) == {"answered"}
    assert ledger.count_by_custom_id() == dict.fromkeys(requests["custom_id"], 1)
    assert len(stats.resent) == wedged.requeued  # each went out again once
    # reclaimed once the endpoint was down (connect_timeout_s), not failed by the read
    # timeout (request_timeout_s), which would have counted a retry
    assert stats.retries == 0


ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": '{"label": "lost_card"}'},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25},
    }
)


@pytest.fixture
def four_slot_server() -> Iterator[dict[str, Any]]:
    """A scripted vLLM server whose time is its /metrics readings, not a clock: of the chat
    requests it holds, up to 4 count as running and the rest as waiting, and it answers none
    until it has reported a queue above the pool's headroom (2) at six readings in a row;
    then it answers everything. The first five span at least a full metrics interval (slow
    start polls every quarter of it), so the pool acts on a lasting queue by the fifth, and
    asks for the sixth only after it has. Where the cap goes thus depends on the readings
    alone, never on how fast anything runs."""
    state: dict[str, Any] = {"held": 0, "congested": 0, "readings": []}
    release = asyncio.Event()
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        running = min(state["held"], 4)
        waiting = state["held"] - running
        state["readings"].append((running, waiting))
        if not release.is_set():
            state["congested"] = state["congested"] + 1 if waiting > 2 else 0
            if state["congested"] == 6:
                release.set()
        return Response(
            f"vllm:num_requests_running {running}.0\n"
            f"vllm:num_requests_waiting {waiting}.0\n"
            "vllm:kv_cache_usage_perc 0.1\n"
        )

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        state["held"] += 1
        try:
            await release.wait()
        finally:
            state["held"] -= 1
        return Response(ANSWER, media_type="application/json")

    server = run_in_thread(app)
    state["url"] = server.base_url + "/v1"
    yield state
    server.stop()


def test_adaptive_cap_grows_on_an_idle_engine_and_shrinks_when_saturated(four_slot_server):
    stats = run_pool(
        make_requests(8, words=4),
        config([four_slot_server["url"]], initial_inflight=1, max_inflight=64),
        lambda frame: None,
    )
    assert stats.answered == 8
    caps = [c for _, c in stats.per_endpoint[four_slot_server["url"]].cap_history]
    # doubled in slow start while the server held all it was sent with nothing waiting: past
    # its 4 slots, since a small queue is what keeps a freed slot busy
    assert caps[:4] == [1, 2, 4, 8]
    assert max(caps) == 8  # ... and no further once 4 waited: the queue it kept stayed small
    # then, the queue having lasted, shrank by its excess over the headroom, to no less than
    # what runs plus that headroom
    assert 6 <= caps[4] < 8 and min(caps[4:]) >= 6
    assert max(w for _, w in four_slot_server["readings"]) == 4  # never more than 8 sent


def test_queue_full_503s_are_retried_and_shrink_the_cap(engines):
    pool = engines(1, EngineConfig(max_num_seqs=4, max_num_queued_reqs=2, time_scale=10.0))
    collect = Collector()
    stats = run_pool(
        make_requests(120, words=4),
        config(pool.urls, initial_inflight=32, max_inflight=32, max_attempts=50),
        collect,
    )
    assert stats.retries > 0
    assert stats.answered == 120 and set(collect.results["status"]) == {"answered"}
    caps = [c for _, c in stats.per_endpoint[pool.urls[0]].cap_history]
    assert min(caps) < 32


def test_bucketing_sends_the_longest_requests_first(engines):
    requests = make_requests(40).with_columns(
        pl.Series("est_input_tokens", [(i * 7) % 40 + 10 for i in range(40)])
    )
    for bucketing in (True, False):
        ledger = BillingLedger()
        pool = engines(1, ledger=ledger)
        run_pool(
            requests,
            config(
                pool.urls,
                adaptive=False,
                initial_inflight=1,
                max_inflight=1,
                bucketing=bucketing,
                prefix_grouping=False,
            ),
            lambda frame: None,
        )
        served = [e["custom_id"] for e in ledger.executions()]  # one at a time: send order
        estimate = dict(zip(requests["custom_id"], requests["est_input_tokens"], strict=True))
        if bucketing:
            assert [estimate[c] for c in served] == sorted(estimate.values(), reverse=True)
        else:
            assert served == requests["custom_id"].to_list()


def test_bucketing_without_estimates_uses_line_length(engines):
    short = make_requests(10, prefix="short", words=2)
    long = make_requests(10, prefix="long", words=200)
    requests = pl.concat([short, long])
    ledger = BillingLedger()
    pool = engines(1, ledger=ledger)
    run_pool(
        requests,
        config(pool.urls, adaptive=False, initial_inflight=1, max_inflight=1),
        lambda frame: None,
    )
    served = [e["custom_id"] for e in ledger.executions()]
    assert all(c.startswith("long") for c in served[:10])


def _grouped_requests(groups: int, per_group: int) -> pl.DataFrame:
    ids, lines = [], []
    for i in range(groups * per_group):
        g = i % groups  # group members scattered through the input, as in real data
        context = f"Account notes for customer {g}: " + " ".join(f"n{g}x{k}" for k in range(120))
        cid = f"g{g:02d}-{i:04d}"
        ids.append(cid)
        lines.append(make_line(cid, f"{context}\nNew message: {i} card late"))
    return pl.DataFrame({"custom_id": ids, "line": lines})


def test_prefix_grouping_keeps_a_group_on_one_engine(engines):
    requests = _grouped_requests(groups=12, per_group=10)
    ids = requests["custom_id"].to_list()
    # The pool's plan, a pure function of the lines: one queue per endpoint, whole groups.
    keys = [prefix_key(orjson.loads(line)["body"], 256) for line in requests["line"]]
    parts = assign_groups(keys, request_weights(requests), 3, bucketing=True)
    plan = [[ids[i] for i in part] for part in parts]
    home = {cid: e for e, queue in enumerate(plan) for cid in queue}
    assert len({(cid[:3], home[cid]) for cid in ids}) == 12  # every group planned whole
    cache_hits: dict[bool, int] = {}
    grouped: list[list[str]] = []
    for grouping in (True, False):
        ledgers = [BillingLedger() for _ in range(3)]
        pools = [engines(1, EngineConfig(time_scale=10.0), ledger=ledger) for ledger in ledgers]
        run_pool(
            requests,
            config(
                [p.urls[0] for p in pools],
                adaptive=False,
                initial_inflight=1,  # one at a time: each engine's answers come in send order
                max_inflight=1,
                prefix_grouping=grouping,
            ),
            lambda frame: None,
        )
        served = [[e["custom_id"] for e in ledger.executions()] for ledger in ledgers]
        assert sorted(cid for order in served for cid in order) == sorted(ids)  # each once
        cache_hits[grouping] = sum(p.engines[0].stats().prefix_cache_hits for p in pools)
        if grouping:
            grouped = served
    for e, order in enumerate(grouped):
        # an engine sends its own queue first and takes another's work only once it ran out
        first_away = next((k for k, cid in enumerate(order) if home[cid] != e), len(order))
        assert all(home[cid] == e for cid in order[:first_away])
        assert all(home[cid] != e for cid in order[first_away:])
        # ... from the back of that queue: what left a group's engine is a queue's tail
        mine = set(order)
        taken = [cid for cid in plan[e] if cid not in mine]
        assert taken == plan[e][len(plan[e]) - len(taken) :]
    # a group kept on one engine has its shared prefix computed there once, not on each of
    # the three (the engines count the prompt tokens their prefix caches served)
    assert cache_hits[True] > cache_hits[False]


def test_request_errors_become_rows_and_transient_ones_are_retried(engines):
    pool = engines(1)
    good = make_requests(5)
    bad = pl.DataFrame(
        {
            "custom_id": ["bad-model", "bad-url", "too-long", "not-json"],
            "line": [
                make_line("bad-model", "hello", model="no-such-model"),
                make_line("bad-url", "hello", url="/v1/embeddings"),
                make_line("too-long", "hello", max_tokens=10**6),
                "{not json",
            ],
        }
    )
    collect = Collector()
    stats = run_pool(pl.concat([good, bad]), config(pool.urls), collect)
    rows = {r["custom_id"]: r for r in collect.results.iter_rows(named=True)}
    assert (stats.answered, stats.errors) == (5, 4)
    assert rows["bad-model"]["status"] == "provider_error"
    assert rows["bad-model"]["error"].startswith("HTTP 404 NotFoundError: The model `no-such")
    assert "not supported by the vllm pool backend" in rows["bad-url"]["error"]
    assert rows["too-long"]["error"].startswith("HTTP 400 BadRequestError: This model's maximum")
    assert "not a JSON object" in rows["not-json"]["error"]
    assert stats.retries == 0  # 4xx are not retried


@pytest.fixture
def flaky_server() -> Iterator[dict[str, Any]]:
    """A server that is healthy but answers every chat request 429 with Retry-After."""
    state: dict[str, Any] = {"calls": 0}
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        state["calls"] += 1
        body = b'{"error":{"message":"slow down","type":"RateLimitError","param":null,"code":429}}'
        return Response(body, 429, {"retry-after": "0.1"}, media_type="application/json")

    server = run_in_thread(app)
    state["url"] = server.base_url + "/v1"
    yield state
    server.stop()


def test_transient_errors_give_up_after_max_attempts_honouring_retry_after(
    flaky_server, monkeypatch
):
    delays: list[float] = []

    def recorded(*args: Any, **kwargs: Any) -> float:
        delays.append(backoff_delay(*args, **kwargs))
        return delays[-1]

    monkeypatch.setattr(runner, "backoff_delay", recorded)  # the waits the pool schedules
    collect = Collector()
    stats = run_pool(
        make_requests(1),
        config([flaky_server["url"]], adaptive=False, max_attempts=3),
        collect,
    )
    (row,) = collect.results.iter_rows(named=True)
    assert row["status"] == "provider_error"
    assert row["error"] == "HTTP 429 RateLimitError: slow down (gave up after 3 attempts)"
    assert flaky_server["calls"] == 3 and stats.retries == 2
    # Retry-After: 0.1 each time; without it the backoff is below that (0.025-0.05, 0.05-0.1)
    assert delays == [0.1, 0.1]


def test_api_key_is_sent_and_a_refused_key_stops_the_run(engines):
    pool = engines(1, api_key="secret")
    stats = run_pool(make_requests(5), config(pool.urls, api_key="secret"), lambda frame: None)
    assert stats.answered == 5
    with pytest.raises(TerminalBackendError, match=r"refused the API key.*LOWTIDE_VLLM_API_KEY"):
        run_pool(make_requests(5), config(pool.urls), lambda frame: None)


def test_every_endpoint_down_stops_with_a_transient_error():
    collect = Collector()
    with pytest.raises(TransientBackendError, match="every vLLM endpoint has been down"):
        run_pool(
            make_requests(3),
            config(["http://127.0.0.1:9/v1"], give_up_after_s=0.5),
            collect,
        )
    assert collect.frames == []  # nothing answered, nothing recorded: the next run sends all


def test_a_failing_checkpoint_stops_the_run(engines):
    pool = engines(1)

    def broken(frame: pl.DataFrame) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        run_pool(make_requests(50), config(pool.urls, checkpoint_every=10), broken)


def test_run_pool_works_inside_a_running_event_loop(engines):
    pool = engines(1)

    async def flow_task() -> int:
        return run_pool(make_requests(10), config(pool.urls), lambda frame: None).answered

    assert asyncio.run(flow_task()) == 10


CHILD = textwrap.dedent(
    """
    import sys
    import duckdb
    import polars as pl
    from lowtide.backends.vllm_pool import PoolConfig, run_pool

    requests_path, db_path, urls = sys.argv[1], sys.argv[2], sys.argv[3].split(",")

    committed = 0

    def checkpoint(frame):
        global committed
        con = duckdb.connect(db_path)
        con.execute("BEGIN")
        con.execute("INSERT INTO results SELECT * FROM frame")
        con.execute("COMMIT")
        con.close()
        committed += frame.height
        print(f"checkpointed {frame.height}", flush=True)
        if committed >= 200:
            sys.stdin.readline()  # wait here for the kill: the run is midway by an event

    config = PoolConfig(urls=tuple(urls), checkpoint_every=25, metrics_interval_s=0.1)
    stats = run_pool(pl.read_parquet(requests_path), config, checkpoint)
    print(f"done {stats.answered}", flush=True)
    """
)


@pytest.mark.slow
def test_a_run_killed_midway_resumes_with_only_the_unanswered_requests(engines, tmp_path):
    ledger = BillingLedger()
    pool = engines(3, EngineConfig(time_scale=4.0), ledger=ledger)
    requests = make_requests(600)
    requests_path = tmp_path / "requests.parquet"
    requests.write_parquet(requests_path)
    db_path = tmp_path / "state.duckdb"
    with duckdb.connect(str(db_path)) as con:
        columns = ", ".join(
            f"{name} {'BIGINT' if dtype == pl.Int64 else 'VARCHAR'}"
            for name, dtype in RESULT_SCHEMA.items()
        )
        con.execute(f"CREATE TABLE results ({columns})")  # no key: duplicates would show
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), str(requests_path), str(db_path), ",".join(pool.urls)],
        stdin=subprocess.PIPE,  # never written: the child blocks on it once midway
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    checkpointed = 0
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("checkpointed"):
            checkpointed += int(line.split()[1])
        if checkpointed >= 200:
            child.send_signal(signal.SIGKILL)
            break
    child.wait(timeout=30)
    child.stdin.close()  # type: ignore[union-attr]
    assert child.returncode == -signal.SIGKILL

    with duckdb.connect(str(db_path)) as con:
        done = {row[0] for row in con.execute("SELECT custom_id FROM results").fetchall()}
    assert 200 <= len(done) < 600
    remaining = requests.filter(~pl.col("custom_id").is_in(list(done)))
    # What the dead client had in flight still runs to the end on the engines (a server does
    # not know its client died); let it finish so the ledger shows the resumed run alone.
    # (an event, not a time: the suite's per-test timeout is the backstop)
    while any(e.stats().running or e.stats().waiting for e in pool.engines):
        time.sleep(0.05)
    before = Counter(ledger.count_by_custom_id())
    orphans = set(before) - done  # ran for the dead client, answer lost with it
    assert orphans <= set(remaining["custom_id"])

    def checkpoint(frame: pl.DataFrame) -> None:
        with duckdb.connect(str(db_path)) as con:
            con.execute("INSERT INTO results SELECT * FROM frame")

    stats = run_pool(remaining, config(pool.urls, checkpoint_every=25), checkpoint)
    assert stats.requests == stats.answered == 600 - len(done)

    with duckdb.connect(str(db_path)) as con:
        total, distinct = con.execute(
            "SELECT count(*), count(DISTINCT custom_id) FROM results"
        ).fetchone()
    assert total == distinct == 600  # the union holds every request exactly once
    sent_again = Counter(ledger.count_by_custom_id()) - before
    assert set(sent_again) == set(remaining["custom_id"])  # only the unanswered were sent
    assert set(sent_again.values()) == {1}


# -- beyond one machine: run-batch shards --------------------------------------------------------

RUN_BATCH_OUTPUT = b"""\
{"id":"vllm-0c1d","custom_id":"doc-0001","response":{"status_code":200,"request_id":"vllm-batch-77ab","body":{"id":"chatcmpl-1","object":"chat.completion","model":"my-model","choices":[{"index":0,"message":{"role":"assistant","content":"positive"},"finish_reason":"stop"}],"usage":{"prompt_tokens":14,"completion_tokens":1,"total_tokens":15,"prompt_tokens_details":null}}},"error":null}
{"id":"vllm-5e6f","custom_id":"doc-0002","response":{"status_code":404,"request_id":"vllm-batch-88cd","body":null},"error":{"error":{"message":"The model `other` does not exist. Valid aliases: my-model.","type":"NotFoundError","param":"model","code":404}}}
{"id":"vllm-9a0b","custom_id":"doc-0003","response":{"status_code":400,"request_id":"vllm-batch-99ef","body":null},"error":"URL /v1/foo is not a supported endpoint. Supported endpoints: /v1/chat/completions"}
"""


def test_run_batch_output_success_and_object_error_read_by_parse_result_lines():
    first_two = b"\n".join(RUN_BATCH_OUTPUT.splitlines()[:2])
    rows = {r["custom_id"]: r for r in parse_result_lines(first_two).iter_rows(named=True)}
    assert rows["doc-0001"]["status"] == "answered"
    assert rows["doc-0001"]["raw_text"] == "positive"
    assert (rows["doc-0001"]["input_tokens"], rows["doc-0001"]["output_tokens"]) == (14, 1)
    assert rows["doc-0001"]["cached_tokens"] is None  # prompt_tokens_details: null
    assert rows["doc-0002"]["status"] == "provider_error"


def test_parse_result_lines_reads_run_batch_string_errors():
    frame = parse_result_lines(RUN_BATCH_OUTPUT)
    assert frame.select("custom_id", "status", "error").rows() == [
        ("doc-0001", "answered", None),
        (
            "doc-0002",
            "provider_error",
            "NotFoundError: The model `other` does not exist. Valid aliases: my-model.",
        ),
        (
            "doc-0003",
            "provider_error",
            "run_batch_error: URL /v1/foo is not a supported endpoint. "
            "Supported endpoints: /v1/chat/completions",
        ),
    ]
    answered, *errors = frame.iter_rows(named=True)
    assert (answered["raw_text"], answered["finish_reason"]) == ("positive", "stop")
    assert (answered["input_tokens"], answered["output_tokens"]) == (14, 1)
    for row in errors:  # an error line carries no answer and no usage
        assert row["raw_text"] is None and row["finish_reason"] is None
        assert row["input_tokens"] is None and row["output_tokens"] is None


def test_run_batch_results_keeps_every_line_and_its_error_text():
    rows = {r["custom_id"]: r for r in run_batch_results(RUN_BATCH_OUTPUT).iter_rows(named=True)}
    assert [rows[c]["status"] for c in ("doc-0001", "doc-0002", "doc-0003")] == [
        "answered",
        "provider_error",
        "provider_error",
    ]
    assert rows["doc-0002"]["error"] == (
        "NotFoundError: The model `other` does not exist. Valid aliases: my-model."
    )
    assert rows["doc-0003"]["error"].startswith("run_batch_error: URL /v1/foo is not a supported")
    assert run_batch_results(b"").height == 0


def test_run_batch_shards_hold_every_stored_line_once(tmp_path):
    requests = make_requests(25)
    paths = write_run_batch_shards(requests, tmp_path, shards=4)
    assert [p.name for p in paths] == [f"shard-{k}.jsonl" for k in range(4)]
    lines = [line for p in paths for line in p.read_text().splitlines()]
    assert sorted(lines) == sorted(requests["line"].to_list())
    for line in lines:  # run-batch input: the stored lines as they are
        assert set(orjson.loads(line)) == {"custom_id", "method", "url", "body"}
    assert [len(p.read_text().splitlines()) for p in paths] == [7, 6, 6, 6]
    assert len(write_run_batch_shards(make_requests(2), tmp_path / "few", shards=4)) == 2


def test_kubernetes_examples_match_the_pool_and_run_batch_helpers():
    import yaml

    k8s = Path(__file__).resolve().parents[2] / "deployments" / "k8s"
    servers = list(yaml.safe_load_all((k8s / "vllm-servers.yaml").read_text()))
    assert [d["kind"] for d in servers] == ["Deployment", "Service"]
    assert servers[1]["spec"]["clusterIP"] == "None"  # headless: one DNS record per pod
    args = servers[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert any(a.startswith("--max-num-seqs=") for a in args)

    # the run finds the servers through the headless Service (tests/test_k8s_manifests.py
    # checks every name, port, claim and secret); here: it gets the pool's key variable
    run_env = set()
    for doc in yaml.safe_load_all((k8s / "lowtide-run.yaml").read_text()):
        text = yaml.safe_dump(doc)
        run_env.update(n for n in (ENV_API_KEY,) if n in text)
    assert ENV_API_KEY in run_env

    (job,) = [
        d
        for d in yaml.safe_load_all((k8s / "vllm-run-batch-indexed-job.yaml").read_text())
        if d and d.get("kind") == "Job"
    ]
    assert job["spec"]["completionMode"] == "Indexed"
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = " ".join(container.get("command", []) + container.get("args", []))
    assert "--max-num-seqs" in command and "--max-num-batched-tokens" in command
