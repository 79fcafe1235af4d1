"""The emulated vLLM server over real HTTP on loopback, through the official openai SDK."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tomllib
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from lowtide.emulator.engine import EngineConfig, Workload, capacity_tokens_per_s
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.server import RunningServer, run_in_thread
from lowtide.emulator.vllm import (
    CUSTOM_ID_HEADER,
    DEFAULT_SERVED_MODEL_NAMES,
    create_vllm_app,
    served_model_names,
)
from lowtide.emulator.vllm_pool import start_engines
from tests.conftest import SAMPLE_JOB

MODEL = "emulated-model"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["card_arrival", "lost_card", "exchange_rate"]},
        "summary": {"type": "string", "maxLength": 60},
        "urgent": {"type": "boolean"},
    },
    "required": ["label", "summary", "urgent"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA}}
# A system prompt every request shares, long enough to span several prefix-cache blocks.
SYSTEM = "You triage customer messages for a bank and answer with one JSON object. " * 10


def _messages(i: int, words: int = 12) -> list[dict[str, str]]:
    text = " ".join(f"w{i}x{k}" for k in range(words))
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Ticket {i}: my card has not arrived yet. {text}"},
    ]


@dataclasses.dataclass
class Served:
    server: RunningServer
    app: Any

    @property
    def url(self) -> str:
        return self.server.base_url + "/v1"

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.server.base_url + path, timeout=10, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.post(self.server.base_url + path, timeout=10, **kw)


@pytest.fixture
def serve() -> Iterator[Any]:
    started: list[RunningServer] = []

    def make(config: EngineConfig | None = None, **kw: Any) -> Served:
        app = create_vllm_app(config or EngineConfig(time_scale=4.0), **kw)
        server = run_in_thread(app)
        started.append(server)
        return Served(server, app)

    yield make
    for server in started:
        server.stop()


async def _drive(
    url: str, concurrency: int, requests: int, *, first: int = 0, max_retries: int = 2
) -> list[Any]:
    """`concurrency` SDK clients in a closed loop; returns the completions."""
    client = AsyncOpenAI(base_url=url, api_key="x", max_retries=max_retries)
    todo = iter(range(first, first + requests))
    done: list[Any] = []

    async def worker() -> None:
        for i in todo:
            done.append(
                await client.chat.completions.create(
                    model=MODEL,
                    messages=_messages(i),
                    response_format=RESPONSE_FORMAT,
                    max_tokens=200,
                )
            )

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return done


def _metrics(served: Served) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Samples by name, then by sorted label pairs."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(served.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _engine_stats(served: Served) -> dict[str, Any]:
    """The engine's counters and simulated-clock integrals (`GET /_emulator/stats`)."""
    return served.get("/_emulator/stats").json()


def _gauges(served: Served) -> dict[str, float]:
    metrics = _metrics(served)
    return {
        "running": _value(metrics, "vllm:num_requests_running"),
        "waiting": _value(metrics, "vllm:num_requests_waiting"),
        "kv": _value(metrics, "vllm:kv_cache_usage_perc"),
    }


async def _until(served: Served, settled: Any) -> dict[str, float]:
    """Poll the server's gauges until `settled(gauges)`; the last gauges. A state that never
    comes is caught by the suite's per-test timeout, not by a clock here."""
    while not settled(gauges := await asyncio.to_thread(_gauges, served)):
        await asyncio.sleep(0.005)
    return gauges


def _value(metrics: dict, name: str, **labels: str) -> float:
    wanted = {"model_name": MODEL, "engine": "0", **labels}
    (value,) = [v for k, v in metrics[name].items() if dict(k) == wanted]
    return value


def test_structured_output_is_schema_valid(serve):
    ledger = BillingLedger()
    served = serve(ledger=ledger)

    async def main() -> None:
        client = AsyncOpenAI(base_url=served.url, api_key="x")
        for i in range(6):
            completion = await client.chat.completions.create(
                model=MODEL,
                messages=_messages(i),
                response_format=RESPONSE_FORMAT,
                max_tokens=200,
                extra_headers={CUSTOM_ID_HEADER: f"row-{i}"},
            )
            choice = completion.choices[0]
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            assert choice.finish_reason == "stop"
            assert completion.model == MODEL and completion.id.startswith("chatcmpl-")
            usage = completion.usage
            assert usage.prompt_tokens > 150 and usage.completion_tokens > 5
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        # vLLM's own structured_outputs field works too; the removed guided_json is ignored.
        via_extra = await client.chat.completions.create(
            model=MODEL, messages=_messages(7), extra_body={"structured_outputs": {"json": SCHEMA}}
        )
        jsonschema.validate(json.loads(via_extra.choices[0].message.content), SCHEMA)
        ignored = await client.chat.completions.create(
            model=MODEL, messages=_messages(8), extra_body={"guided_json": SCHEMA}
        )
        with pytest.raises(json.JSONDecodeError):
            json.loads(ignored.choices[0].message.content)
        cut = await client.chat.completions.create(
            model=MODEL, messages=_messages(9), response_format=RESPONSE_FORMAT, max_tokens=3
        )
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
        models = await client.models.list()
        assert [m.id for m in models.data] == list(DEFAULT_SERVED_MODEL_NAMES)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="other", messages=_messages(0))
        await client.close()

    asyncio.run(main())
    raw = served.post("/v1/chat/completions", json={"model": "other", "messages": _messages(0)})
    assert raw.status_code == 404
    assert raw.json()["error"] == {
        "message": "The model `other` does not exist. Valid aliases: "
        f"{', '.join(DEFAULT_SERVED_MODEL_NAMES)}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    executions = ledger.executions("vllm")
    assert len(executions) == 9
    assert [e["custom_id"] for e in executions[:6]] == [f"row-{i}" for i in range(6)]
    assert all(e["kind"] == "realtime" and e["model"] == MODEL for e in executions)


def test_throughput_rises_with_concurrency_and_stays_under_capacity(serve):
    # Measured on the engine's simulated clock (`/_emulator/stats` before and after each
    # phase): generated tokens per simulated second of engine work, and the mean number of
    # sequences per step. A busy host makes the test slower, not its numbers different.
    config = EngineConfig(max_num_seqs=16, time_scale=2.0)
    served = serve(config)
    start = _engine_stats(served)
    done_1 = asyncio.run(_drive(served.url, 1, 6))
    mid = _engine_stats(served)
    before = _metrics(served)
    done_32 = asyncio.run(_drive(served.url, 32, 160, first=1000))
    end = _engine_stats(served)
    after = _metrics(served)

    def delta(name: str) -> float:
        return _value(after, name) - _value(before, name)

    def rate(a: dict[str, Any], b: dict[str, Any]) -> float:
        tokens = b["generation_tokens_total"] - a["generation_tokens_total"]
        return tokens / (b["sim_seconds"] - a["sim_seconds"])

    def batch(a: dict[str, Any], b: dict[str, Any]) -> float:
        running = b["running_seq_seconds"] - a["running_seq_seconds"]
        return running / (b["sim_seconds"] - a["sim_seconds"])

    # the engine counted exactly the work the clients were answered
    assert delta("vllm:generation_tokens_total") == sum(c.usage.completion_tokens for c in done_32)
    assert mid["generation_tokens_total"] - start["generation_tokens_total"] == sum(
        c.usage.completion_tokens for c in done_1
    )
    workload = Workload(
        prompt_tokens=sum(c.usage.prompt_tokens for c in done_32) / len(done_32),
        output_tokens=sum(c.usage.completion_tokens for c in done_32) / len(done_32),
        prefix_share=delta("vllm:prefix_cache_hits_total")
        / delta("vllm:prefix_cache_queries_total"),
    )
    # the ceiling per simulated second (capacity is per wall second at the config's scale)
    ceiling = capacity_tokens_per_s(dataclasses.replace(config, time_scale=1.0), workload)
    rate_1, rate_32 = rate(start, mid), rate(mid, end)
    assert batch(start, mid) == pytest.approx(1.0)  # one client: one sequence per step
    assert batch(mid, end) > config.max_num_seqs / 2  # 32 clients kept the 16 slots busy
    assert rate_32 > 4 * rate_1, (rate_1, rate_32, ceiling)
    assert rate_32 <= 1.05 * ceiling
    assert rate_32 > 0.5 * ceiling, (rate_32, ceiling)


def test_metrics_carry_vllm_names_and_count_the_work(serve):
    served = serve(EngineConfig(time_scale=8.0), enable_prompt_tokens_details=True)
    done = asyncio.run(_drive(served.url, 4, 16))
    metrics = _metrics(served)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert name in metrics, name
    assert _value(metrics, "vllm:num_requests_running") == 0
    assert _value(metrics, "vllm:request_success_total", finished_reason="stop") == 16
    assert _value(metrics, "vllm:generation_tokens_total") == sum(
        c.usage.completion_tokens for c in done
    )
    assert _value(metrics, "vllm:prompt_tokens_total") == sum(c.usage.prompt_tokens for c in done)
    hits = _value(metrics, "vllm:prefix_cache_hits_total")
    assert hits > 0  # the shared system prompt
    assert hits == sum(c.usage.prompt_tokens_details.cached_tokens for c in done)
    assert _value(metrics, "vllm:e2e_request_latency_seconds_count") == 16
    assert served.get("/health").status_code == 200 and served.get("/health").content == b""


def test_long_prompts_and_kv_budget_show_up_as_waiting(serve):
    # 0.1 s steps: a burst of 16 is at the server long before its first request could
    # finish (30-odd steps), so the gauges settle on what the engine's limits allow, whatever
    # the host's speed; killing the engine then ends the burst without waiting for it.
    slow = {"decode_step_s_base": 0.1, "time_scale": 1.0}
    # Long prompts and a small step budget: the 4 slots fill one prefill after another while
    # the rest wait.
    slow_prefill = serve(EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, **slow))
    # KV for about three such prompts although 64 slots are free.
    small_kv = serve(EngineConfig(kv_cache_tokens=3600, max_model_len=2048, **slow))

    async def burst(served: Served, settled: Any) -> dict[str, float]:
        client = AsyncOpenAI(base_url=served.url, api_key="x", max_retries=0)
        tasks = [
            asyncio.create_task(
                client.chat.completions.create(
                    model=MODEL, messages=_messages(i, words=300), response_format=RESPONSE_FORMAT
                )
            )
            for i in range(16)
        ]
        gauges = await _until(served, lambda g: settled(g) or any(t.done() for t in tasks))
        await asyncio.to_thread(served.post, "/_emulator/kill")
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, openai.InternalServerError) for o in outcomes)  # none ended
        await client.close()
        return gauges

    # waited for: the whole burst at the server and the limit reached (or a request ended)
    gauges = asyncio.run(
        burst(slow_prefill, lambda g: g["running"] == 4 and g["running"] + g["waiting"] == 16)
    )
    assert (gauges["running"], gauges["waiting"]) == (4, 12)
    gauges = asyncio.run(
        burst(small_kv, lambda g: g["kv"] > 0.7 and g["running"] + g["waiting"] == 16)
    )
    assert 0 < gauges["running"] <= 4 and gauges["waiting"] >= 12 and gauges["kv"] > 0.7


def test_queue_cap_answers_503(serve):
    # One slot and 0.1 s steps: the first request runs for seconds while two more queue.
    config = EngineConfig(
        max_num_seqs=1, max_num_queued_reqs=2, decode_step_s_base=0.1, time_scale=1.0
    )
    served = serve(config)

    async def main() -> None:
        client = AsyncOpenAI(base_url=served.url, api_key="x", max_retries=0)

        def send(i: int) -> asyncio.Task:
            return asyncio.create_task(
                client.chat.completions.create(
                    model=MODEL, messages=_messages(i), response_format=RESPONSE_FORMAT
                )
            )

        # One at a time: three requests arriving before the engine's first step would all
        # count as waiting, and the third would already be refused.
        queued = [send(0)]
        await _until(served, lambda g: g["running"] == 1)
        queued += [send(1), send(2)]
        await _until(served, lambda g: g["waiting"] == 2)
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=_messages(9))
        assert info.value.status_code == 503
        assert info.value.body["code"] == 503
        # Do not wait seconds for the queue to drain: kill the engine, failing what it holds.
        await asyncio.to_thread(served.post, "/_emulator/kill")
        outcomes = await asyncio.gather(*queued, return_exceptions=True)
        assert all(isinstance(o, openai.InternalServerError) for o in outcomes)
        await client.close()

    asyncio.run(main())


def test_api_key_guards_v1_routes_only(serve):
    served = serve(api_key="secret")
    body = {"model": MODEL, "messages": _messages(0)}
    missing = served.post("/v1/chat/completions", json=body)
    assert missing.status_code == 401 and missing.json() == {"error": "Unauthorized"}
    wrong = served.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = served.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200
    assert served.get("/health").status_code == 200
    assert served.get("/metrics").status_code == 200


def test_kill_makes_health_503_and_requests_fail_until_revived(serve):
    served = serve()
    assert served.post("/_emulator/kill").status_code == 200
    assert served.get("/health").status_code == 503
    dead = served.post("/v1/chat/completions", json={"model": MODEL, "messages": _messages(0)})
    assert dead.status_code == 500 and dead.json()["error"]["code"] == 500
    served.post("/_emulator/revive")
    assert served.get("/health").status_code == 200
    alive = served.post("/v1/chat/completions", json={"model": MODEL, "messages": _messages(0)})
    assert alive.status_code == 200


def test_stopping_one_engine_of_a_pool_fails_only_its_requests():
    config = EngineConfig(max_num_seqs=8, time_scale=4.0)
    with start_engines(3, config) as pool:
        assert len(set(pool.urls)) == 3

        async def main() -> dict[int, dict[str, Any]]:
            results = {i: {"ok_after_stop": 0, "errors": []} for i in range(3)}
            stopped = asyncio.Event()
            clients = [AsyncOpenAI(base_url=url, api_key="x", max_retries=0) for url in pool.urls]

            # Engine 1 stops once every worker has had an answer: each has 15 more to send.
            workers = [(i, k) for i in range(3) for k in range(6)]
            answered: set[tuple[int, int]] = set()
            all_answered = asyncio.Event()

            async def worker(i: int, k: int) -> None:
                n = 0
                while n < 16:
                    n += 1
                    try:
                        await clients[i].chat.completions.create(
                            model=MODEL, messages=_messages(i * 1000 + k * 50 + n)
                        )
                    except openai.APIError as exc:
                        results[i]["errors"].append(exc)
                        if stopped.is_set() and n > 5:
                            return
                        continue
                    answered.add((i, k))
                    if len(answered) == len(workers):
                        all_answered.set()
                    if stopped.is_set():
                        results[i]["ok_after_stop"] += 1

            async def stop_engine_1() -> None:
                await all_answered.wait()
                await asyncio.to_thread(pool.stop, 1)
                stopped.set()

            await asyncio.gather(stop_engine_1(), *(worker(i, k) for i, k in workers))
            for client in clients:
                await client.close()
            return results

        results = asyncio.run(main())
        assert results[0]["errors"] == [] and results[2]["errors"] == []
        assert results[0]["ok_after_stop"] > 0 and results[2]["ok_after_stop"] > 0
        errors = results[1]["errors"]
        assert errors and all(isinstance(e, openai.APIConnectionError) for e in errors)
        with pytest.raises(httpx.ConnectError):
            httpx.get(pool.base_url(1) + "/health", timeout=2)
        assert httpx.get(pool.base_url(0) + "/health", timeout=30).status_code == 200


def test_a_server_answers_to_every_name_it_serves(serve):
    """vLLM's `--served-model-name a b`: any served name is answered, under the first name;
    the default serves the sample job's vLLM model id; other names get the 404."""
    with open(SAMPLE_JOB, "rb") as f:
        sample_vllm_model = tomllib.load(f)["model"]["names"]["vllm"]
    assert MODEL == DEFAULT_SERVED_MODEL_NAMES[0]
    assert sample_vllm_model in DEFAULT_SERVED_MODEL_NAMES
    ledger = BillingLedger()
    served = serve(ledger=ledger, served_model_name="my-model, my-alias")
    client = openai.OpenAI(base_url=served.url, api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["my-model", "my-alias"]
    for name in ("my-model", "my-alias"):
        completion = client.chat.completions.create(model=name, messages=_messages(1))
        assert completion.model == "my-model"
    with pytest.raises(openai.NotFoundError, match="Valid aliases: my-model, my-alias"):
        client.chat.completions.create(model=MODEL, messages=_messages(2))
    assert [e["model"] for e in ledger.executions("vllm")] == ["my-model", "my-model"]
    assert 'model_name="my-model"' in served.get("/metrics").text
    client.close()


def test_served_model_names_accepts_repeats_and_commas():
    assert served_model_names("a") == ("a",)
    assert served_model_names(["a,b", " c ", "a"]) == ("a", "b", "c")
    with pytest.raises(ValueError, match="at least one"):
        served_model_names([" , "])
