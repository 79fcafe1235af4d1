"""The simulated continuous-batching engine, driven directly (no HTTP).

The tests run in virtual time (`time_scale=inf`): the scheduler never sleeps, so what is
asserted are simulated seconds and counters, which do not depend on how busy the machine is.
Arrivals are paced on the engine's simulated clock too. How the engine paces itself against
the wall clock is checked with a clock that only its own sleeps move.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import pytest

from lowtide.emulator import engine as engine_module
from lowtide.emulator.engine import (
    Engine,
    EngineConfig,
    EngineDeadError,
    QueueFullError,
    RequestTooLongError,
    Workload,
    capacity,
    capacity_tokens_per_s,
    prefix_block_hashes,
)

VIRTUAL = math.inf
SHARED = list(range(1000, 1160))  # a 160-token "system prompt" (10 full blocks)


def _prompt(i: int, length: int, shared: bool = True) -> tuple[int, tuple[int, ...]]:
    """(prompt_tokens, block hashes) for request i: a shared head, then tokens unique to i."""
    head = SHARED[: min(len(SHARED), length)] if shared else []
    ids = head + [100_000 + i * 7 + k for k in range(length - len(head))]
    return length, prefix_block_hashes(ids)


async def _closed_loop(
    engine: Engine,
    concurrency: int,
    requests: int,
    prompt_len: int = 300,
    output: int = 40,
    shared: bool = True,
) -> list:
    """`concurrency` clients that each send the next request as soon as one finishes."""
    todo = iter(range(requests))
    results = []

    async def client() -> None:
        for i in todo:
            tokens, hashes = _prompt(i, prompt_len, shared)
            results.append(
                await engine.generate(
                    prompt_tokens=tokens, output_tokens=output, block_hashes=hashes
                )
            )

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return results


async def _open_loop(engine: Engine, n: int, gap_s: float, length: int) -> list[int]:
    """Open-loop arrivals on the engine's simulated clock (virtual time): a request every
    `gap_s` simulated seconds. That clock only runs while the engine works, so an idle gap
    before an arrival is skipped (nothing happens in it). Returns the queue length seen just
    before each next arrival."""
    waiting, tasks = [], []
    start, skipped = engine.stats().sim_seconds, 0.0
    for k in range(n):
        tasks.append(asyncio.create_task(engine.generate(prompt_tokens=length, output_tokens=20)))
        await asyncio.sleep(0)  # the request joins the queue
        due = start + (k + 1) * gap_s - skipped
        while (stats := engine.stats()).sim_seconds < due:
            if not (stats.running or stats.waiting):
                skipped += due - stats.sim_seconds
                break
            await asyncio.sleep(0)  # one engine step
        waiting.append(engine.stats().waiting)
    await asyncio.gather(*tasks)
    return waiting


def _sim_rate(engine: Engine) -> float:
    stats = engine.stats()
    return stats.generation_tokens_total / stats.sim_seconds


def _run(coro):
    return asyncio.run(coro)


def test_prefix_block_hashes_are_chained():
    a = prefix_block_hashes(list(range(40)))
    b = prefix_block_hashes(list(range(32)) + [0] * 8)
    c = prefix_block_hashes([99] + list(range(1, 40)))
    assert len(a) == 2  # the 8-token tail is not a full block
    assert a == b  # equal first 32 tokens, equal hashes
    assert not set(a) & set(c)  # a different first token changes every later block's hash


def test_capacity_names_the_binding_limit():
    base = EngineConfig(time_scale=1.0)
    work = Workload(prompt_tokens=300, output_tokens=40, prefix_share=0.3)
    assert capacity(base, work).limited_by == "max_num_seqs"
    tight_kv = dataclasses.replace(base, kv_cache_tokens=6000, max_model_len=4096)
    assert capacity(tight_kv, work).limited_by == "kv_cache"
    tight_budget = dataclasses.replace(base, max_num_batched_tokens=1024, max_model_len=1000)
    long_prompts = Workload(prompt_tokens=800, output_tokens=40)
    assert capacity(tight_budget, long_prompts).limited_by == "token_budget"
    # More slots or a warmer prefix cache can only raise the ceiling; time_scale scales it.
    more = dataclasses.replace(base, max_num_seqs=128)
    assert capacity_tokens_per_s(more, work) > capacity_tokens_per_s(base, work)
    cold = Workload(300, 40, 0.0)
    assert capacity_tokens_per_s(base, work) > capacity_tokens_per_s(base, cold)
    fast = dataclasses.replace(base, time_scale=10.0)
    assert capacity_tokens_per_s(fast, work) == pytest.approx(
        10 * capacity_tokens_per_s(base, work)
    )


def test_throughput_rises_with_concurrency_and_stays_under_capacity():
    config = EngineConfig(max_num_seqs=32, time_scale=VIRTUAL)
    rates = {}
    for concurrency in (1, 4, 16, 32, 64):
        engine = Engine(config)
        _run(_closed_loop(engine, concurrency, requests=max(8, concurrency * 6)))
        rates[concurrency] = _sim_rate(engine)
        stats = engine.stats()
        share = stats.prefix_cache_hits / stats.prefix_cache_queries
    ceiling = capacity_tokens_per_s(
        dataclasses.replace(config, time_scale=1.0), Workload(300, 40, share)
    )
    assert rates[1] < rates[4] < rates[16] < rates[32]
    assert rates[32] > 10 * rates[1]
    # Saturated: more clients than slots adds nothing, and the ceiling is approached, not beaten.
    assert rates[64] == pytest.approx(rates[32], rel=0.1)
    assert 0.8 * ceiling < rates[64] <= ceiling


def test_long_prompts_hold_slots_and_requests_wait():
    # Open-loop arrivals, one every 0.2 simulated seconds, into 4 slots with a 512-token step
    # budget. Short prompts are served faster than they arrive; a 4000-token prompt needs 8
    # prefill steps, so the same arrival rate outruns the engine and the queue grows.
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, time_scale=VIRTUAL)

    async def arrivals(engine: Engine, length: int) -> list[int]:
        waiting = await _open_loop(engine, 60, 0.2, length)
        await engine.aclose()
        return waiting

    short_engine, long_engine = Engine(config), Engine(config)
    short = _run(arrivals(short_engine, 100))
    long = _run(arrivals(long_engine, 4000))
    assert max(short) == 0 and short_engine.stats().queue_time.sum == 0  # nothing waits
    assert long[-1] >= 10
    assert long[-1] > long[len(long) // 2] > long[len(long) // 6]
    stats = long_engine.stats()
    assert stats.running_seq_seconds / stats.sim_seconds > 3  # the slots stay taken
    assert stats.queue_time.count == 60 and stats.queue_time.sum / 60 > 1.0  # seconds queued


def test_kv_budget_makes_requests_wait_and_preempts():
    # Room for 4 prompts of 1000 tokens although 32 slots are free; their outputs of 400
    # tokens then outgrow the cache, so the newest running request is preempted.
    config = EngineConfig(
        max_num_seqs=32, kv_cache_tokens=5000, max_model_len=2048, time_scale=VIRTUAL
    )
    engine = Engine(config)
    seen = {"running": 0, "kv": 0.0}

    async def main() -> list:
        async def watch() -> None:
            while True:
                stats = engine.stats()
                seen["running"] = max(seen["running"], stats.running)
                seen["kv"] = max(seen["kv"], stats.kv_usage)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        results = await _closed_loop(engine, 16, 32, prompt_len=1000, output=400, shared=False)
        watcher.cancel()
        return results

    results = _run(main())
    stats = engine.stats()
    assert len(results) == 32 and all(r.output_tokens == 400 for r in results)
    assert seen["running"] <= 5
    assert seen["kv"] > 0.9
    assert stats.waiting_seq_seconds / stats.sim_seconds > 8  # the rest queue
    assert stats.preemptions > 0  # outputs grew into each other's KV
    assert stats.generation_tokens_total == 32 * 400
    assert stats.kv_blocks_used == 0  # everything freed at the end


def test_prefix_cache_hits_and_saves_prefill():
    def run(prefix_cache: bool) -> tuple:
        config = EngineConfig(prefix_cache=prefix_cache, time_scale=VIRTUAL)
        engine = Engine(config)
        results = _run(_closed_loop(engine, 4, 40, prompt_len=400, output=10))
        return engine.stats(), results

    cached, cached_results = run(True)
    cold, cold_results = run(False)
    assert cold.prefix_cache_hits == 0
    assert cached.prefix_cache_queries == 40 * 400
    # 160 shared tokens of 400; only the first wave of 4 requests misses.
    assert cached.prefix_cache_hits == pytest.approx(36 * 160, abs=16 * 4)
    assert cached.prefill_tokens_computed < cold.prefill_tokens_computed - 30 * 160
    assert cached.prefill_seconds < 0.7 * cold.prefill_seconds
    assert sum(r.cached_tokens for r in cached_results) == cached.prefix_cache_hits
    assert all(r.cached_tokens == 0 for r in cold_results)
    mean_ttft = sum(r.ttft_s for r in cached_results) / len(cached_results)
    assert mean_ttft < sum(r.ttft_s for r in cold_results) / len(cold_results)


def test_identical_prompt_recomputes_only_the_last_token():
    engine = Engine(EngineConfig(time_scale=VIRTUAL))
    tokens, hashes = _prompt(0, 64)  # exactly 4 full blocks

    async def twice():
        first = await engine.generate(prompt_tokens=tokens, output_tokens=5, block_hashes=hashes)
        second = await engine.generate(prompt_tokens=tokens, output_tokens=5, block_hashes=hashes)
        return first, second

    first, second = _run(twice())
    assert first.cached_tokens == 0
    assert second.cached_tokens == 48  # the last block is recomputed to produce a token
    assert engine.stats().request_success["stop"] == 2


def test_queue_cap_refuses_and_context_limit_rejects():
    engine = Engine(EngineConfig(max_num_seqs=1, max_num_queued_reqs=2, time_scale=VIRTUAL))

    async def main() -> None:
        with pytest.raises(RequestTooLongError) as info:
            await engine.generate(prompt_tokens=32_000, output_tokens=1000)
        assert info.value.limit == 32_768
        # The scheduler has not run yet when these are queued, so all three wait.
        tasks = [
            asyncio.create_task(engine.generate(prompt_tokens=10, output_tokens=50))
            for _ in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await engine.generate(prompt_tokens=10, output_tokens=50)
        assert len(await asyncio.gather(*tasks)) == 2

    _run(main())


def test_kill_fails_in_flight_requests_and_revive_serves_again():
    engine = Engine(EngineConfig(time_scale=VIRTUAL))

    async def main() -> None:
        pending = [
            asyncio.create_task(engine.generate(prompt_tokens=100, output_tokens=500))
            for _ in range(3)
        ]
        while engine.stats().running < 3:  # admitted: in flight, 500 tokens from done
            await asyncio.sleep(0)
        assert engine.stats().generation_tokens_total < 3 * 500
        engine.kill()
        for task in pending:
            with pytest.raises(EngineDeadError):
                await task
        with pytest.raises(EngineDeadError):
            await engine.generate(prompt_tokens=10, output_tokens=5)
        assert engine.stats().running == 0
        engine.revive()
        result = await engine.generate(prompt_tokens=10, output_tokens=5)
        assert result.output_tokens == 5
        await engine.aclose()

    _run(main())


def test_cancelled_request_frees_its_slot():
    engine = Engine(EngineConfig(max_num_seqs=1, time_scale=VIRTUAL))

    async def main() -> None:
        hog = asyncio.create_task(engine.generate(prompt_tokens=10, output_tokens=10_000))
        while engine.stats().running == 0:
            await asyncio.sleep(0)
        hog.cancel()
        result = await engine.generate(prompt_tokens=10, output_tokens=3)
        assert result.output_tokens == 3
        assert engine.stats().request_success["abort"] == 1
        assert engine.stats().kv_blocks_used == 0

    _run(main())


class _PacedClock:
    """The wall clock an engine paces itself by, moved only by the engine's own sleeps (and by
    `stall_at_sleep`: a busy CPU), so how it paces is checked without waiting on real time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.stall_at_sleep: dict[int, float] = {}  # the n-th sleep comes back this late
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def asyncio(self) -> Any:
        """`asyncio` as the engine module sees it, with a `sleep` that moves this clock."""
        clock = self

        class _Asyncio:
            def __getattr__(self, name: str) -> Any:
                return getattr(asyncio, name)

            @staticmethod
            async def sleep(delay: float, result: Any = None) -> Any:
                clock.sleeps += 1
                clock.now += max(delay, 0.0) + clock.stall_at_sleep.get(clock.sleeps, 0.0)
                return await asyncio.sleep(0, result)

        return _Asyncio()


@pytest.mark.parametrize(
    ("stall_s", "dropped"),
    [
        (0.0, False),  # on schedule: wall time = simulated time / time_scale, exactly
        (0.1, False),  # behind by less than max_lag_s: caught up, the run ends on schedule
        (2.0, True),  # behind by more: the lost time is dropped, never made up by running fast
    ],
)
def test_wall_clock_follows_the_time_scale(monkeypatch, stall_s, dropped):
    # 32 equal requests queued at once into 8 slots: four waves of 40 steps, never idle.
    config = EngineConfig(max_num_seqs=8, time_scale=5.0)
    clock = _PacedClock()
    clock.stall_at_sleep[20] = stall_s  # one step of the first wave comes back late
    monkeypatch.setattr(engine_module, "asyncio", clock.asyncio())
    engine = Engine(config, clock=clock)

    async def burst() -> None:
        await asyncio.gather(
            *(engine.generate(prompt_tokens=200, output_tokens=40) for _ in range(32))
        )
        await engine.aclose()

    _run(burst())
    stats = engine.stats()
    assert stats.steps == clock.sleeps == 4 * 40  # one sleep per step
    late = clock.now - stats.sim_seconds / config.time_scale
    if dropped:  # re-anchored at the next step, whose own time is dropped with the lag
        assert late == pytest.approx(stall_s - config.step_seconds(8, 0) / config.time_scale)
    else:
        assert late == pytest.approx(0.0, abs=1e-9)
