"""A simulated continuous-batching inference engine: the timing model behind the emulated vLLM.

No GPU and no real model: the engine moves token counts through a scheduler that behaves like
vLLM's (V1) and sleeps for as long as each step would take on a GPU, so a client sees the same
shapes a real server shows — a fixed number of sequence slots, a per-step token budget, a KV
cache that fills up, prefix caching, preemption — and achieved throughput can be compared with a
ceiling computed from the same numbers.

The model, in simulated seconds:

- Requests wait in a FIFO queue. One is admitted when a sequence slot is free
  (`max_num_seqs`) and the KV blocks for its whole prompt (plus one output token) are free.
  Admission is first come, first served: a request that does not fit blocks those behind it.
- Each step fills a token budget (`max_num_batched_tokens`): first one decode token for every
  running sequence that has finished its prefill, then prompt chunks (chunked prefill) for
  sequences still prefilling, in admission order, then newly admitted requests.
- A step lasts `decode_step_s_base + decode_step_s_per_seq * n + prefill_tokens /
  prefill_tokens_per_s`, where `n` is the number of sequences that emit a token in the step
  (decoders plus those whose prefill completes). Per-sequence speed falls as the batch grows
  while total throughput rises towards a ceiling.
- KV is counted in blocks of `block_size` tokens. A request holds blocks for its prompt and for
  the tokens it has generated so far; output grows KV block by block. When a decode step finds
  no free block, the newest running request is preempted (vLLM's recompute mode): its blocks are
  freed and it returns to the head of the queue, later re-prefilling prompt + output so far.
  No new request is admitted in a step that preempted.
- Prefix caching: full prompt blocks are identified by chained hashes (each block's hash covers
  every token before it, as in vLLM). Blocks computed by earlier requests stay cached (LRU, at
  most as many blocks as the KV cache holds) and a new request skips prefilling its longest
  cached prefix; at least one prompt token is always computed. Blocks shared by running
  requests occupy KV once.

`time_scale` compresses time: simulated step durations are divided by it on the wall clock.
`time_scale=inf` never sleeps (virtual time), which makes scheduling tests deterministic.

This module is the scheduler. The numbers and the ceiling maths (`EngineConfig`, `capacity`,
`prefix_block_hashes`) live in `engine_capacity` and the records it hands back (results, stats,
errors) in `engine_reports`; both are re-exported here, the engine's public import path. A
request's own state while it is inside the engine is `engine_sequence.Seq`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from lowtide.emulator.engine_capacity import (
    Capacity,
    EngineConfig,
    Workload,
    capacity,
    capacity_tokens_per_s,
    prefix_block_hashes,
)
from lowtide.emulator.engine_reports import (
    FINISH_REASONS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineDeadError,
    EngineStats,
    GenerationResult,
    Histogram,
    QueueFullError,
    RequestTooLongError,
)
from lowtide.emulator.engine_sequence import DONE, RUNNING, WAITING, Seq

# The engine's public face: its config, ceiling and report types are imported from here too.
__all__ = [
    "Capacity",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "GenerationResult",
    "QueueFullError",
    "RequestTooLongError",
    "Workload",
    "capacity",
    "capacity_tokens_per_s",
    "prefix_block_hashes",
]


class Engine:
    """One simulated engine. Drive it from a single asyncio event loop: `generate` starts the
    scheduler task on first use; `kill`, `revive` and `aclose` must be called on that loop."""

    def __init__(self, config: EngineConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._alive = True
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._reset_state()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._prefill_computed = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions = 0
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self._steps = 0
        self._sim = 0.0
        self._prefill_seconds = 0.0
        self._running_integral = 0.0
        self._waiting_integral = 0.0
        self._ttft = Histogram(TTFT_BUCKETS)
        self._e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self._queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self._anchor_sim = 0.0
        self._anchor_wall = 0.0

    def _reset_state(self) -> None:
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._in_use: dict[int, int] = {}  # shared block hash -> holders
        self._private_total = 0
        self._cached: OrderedDict[int, None] = OrderedDict()

    # -- public -----------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._alive

    async def generate(
        self,
        *,
        prompt_tokens: int,
        output_tokens: int,
        block_hashes: Sequence[int] = (),
        finish_reason: str = "stop",
    ) -> GenerationResult:
        """Queue a request, wait until the engine has produced `output_tokens` tokens for it,
        and return its timings. `finish_reason` is what the request finishes with ("stop" or
        "length"); the engine only counts it.

        Raises EngineDeadError (killed before or during), QueueFullError (queue at its cap) or
        RequestTooLongError (prompt + output over `max_model_len`). Cancelling the awaiting
        task aborts the request and frees its slot."""
        if not self._alive:
            raise EngineDeadError("engine is dead (killed); revive it or use another endpoint")
        output_tokens = max(int(output_tokens), 1)
        limit = self.config.max_model_len
        if prompt_tokens + output_tokens > limit:
            raise RequestTooLongError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + output_tokens} tokens ({prompt_tokens} in the messages, "
                f"{output_tokens} in the completion). Please reduce the length of the messages "
                "or completion.",
                prompt_tokens=prompt_tokens,
                output_tokens=output_tokens,
                limit=limit,
            )
        cap = self.config.max_num_queued_reqs
        if cap is not None and len(self._waiting) >= cap:
            raise QueueFullError(
                f"Engine queue is full: {len(self._waiting)} requests waiting "
                f"(max_num_queued_reqs={cap}); retry later or send to another endpoint"
            )
        self._ensure_loop()
        loop = asyncio.get_running_loop()
        hashes = tuple(block_hashes)[: prompt_tokens // self.config.block_size]
        seq = Seq(prompt_tokens, hashes, output_tokens, finish_reason, loop.create_future(),
                   self._sim_now())  # fmt: skip
        self._waiting.append(seq)
        assert self._wake is not None
        self._wake.set()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            self._abort(seq)
            raise

    def stats(self) -> EngineStats:
        used = self._used_blocks()
        return EngineStats(
            alive=self._alive,
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=used / self.config.kv_blocks,
            kv_blocks_used=used,
            kv_blocks_total=self.config.kv_blocks,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefill_tokens_computed=self._prefill_computed,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            preemptions=self._preemptions,
            request_success=dict(self._success),
            steps=self._steps,
            sim_seconds=self._sim,
            prefill_seconds=self._prefill_seconds,
            running_seq_seconds=self._running_integral,
            waiting_seq_seconds=self._waiting_integral,
            ttft=self._ttft,
            e2e_latency=self._e2e,
            queue_time=self._queue,
        )

    def kill(self) -> None:
        """Stop the engine as if its process died: every queued or running request fails with
        EngineDeadError and new ones are refused until `revive`. Counters are kept."""
        self._alive = False
        if self._task is not None:
            self._task.cancel()
            self._task = None
        error = EngineDeadError("engine died while the request was in flight")
        for seq in (*self._running, *self._waiting):
            seq.state = DONE
            if not seq.future.done():
                seq.future.set_exception(error)
        self._reset_state()

    def revive(self) -> None:
        """Bring a killed engine back, empty (no queue, cold prefix cache)."""
        self._alive = True

    async def aclose(self) -> None:
        """Kill the engine and wait for its scheduler task to end."""
        task = self._task
        self.kill()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- scheduler loop ---------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-engine")

    def _sim_now(self) -> float:
        if not self._running and not self._waiting:
            return self._sim
        if math.isinf(self.config.time_scale):
            return self._sim
        elapsed = (self._clock() - self._anchor_wall) * self.config.time_scale
        return min(self._sim, self._anchor_sim + elapsed)

    def _anchor(self) -> None:
        self._anchor_sim = self._sim
        self._anchor_wall = self._clock()

    async def _run(self) -> None:
        assert self._wake is not None
        scale = self.config.time_scale
        self._anchor()
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                self._anchor()
                continue
            plan = self._schedule()
            if plan is None:  # nothing fits and nothing runs: wait for an abort or arrival
                self._wake.clear()
                await self._wake.wait()
                self._anchor()
                continue
            prefill, decode = plan
            n_prefill = sum(chunk for _, chunk in prefill)
            n_emit = len(decode) + sum(
                1 for seq, chunk in prefill if seq.prefilled + chunk >= seq.prefill_target
            )
            dt = self.config.step_seconds(n_emit, n_prefill)
            self._steps += 1
            self._prefill_seconds += n_prefill / self.config.prefill_tokens_per_s
            self._running_integral += len(self._running) * dt
            self._waiting_integral += len(self._waiting) * dt
            self._sim += dt
            if math.isinf(scale):
                await asyncio.sleep(0)
            else:
                delay = self._anchor_wall + (self._sim - self._anchor_sim) / scale - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                else:
                    if -delay > self.config.max_lag_s:
                        self._anchor()
                    await asyncio.sleep(0)
            self._apply(prefill, decode)

    def _used_blocks(self) -> int:
        return len(self._in_use) + self._private_total

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _schedule(self) -> tuple[list[tuple[Seq, int]], list[Seq]] | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        prefill: list[tuple[Seq, int]] = []
        decode: list[Seq] = []
        preempted = False
        for seq in list(self._running):
            if budget <= 0:
                break
            if seq.state != RUNNING:  # preempted earlier in this loop
                continue
            if seq.prefilled < seq.prefill_target:
                chunk = min(seq.prefill_target - seq.prefilled, budget)
                prefill.append((seq, chunk))
                budget -= chunk
                continue
            if not self._grow(seq):
                while seq.state == RUNNING and not self._grow(seq):
                    self._preempt(self._running[-1])
                    preempted = True
                if seq.state != RUNNING:
                    continue
            decode.append(seq)
            budget -= 1
        # vLLM admits nothing in a step that preempted, unless the step would otherwise be empty.
        while (
            self._waiting
            and budget > 0
            and len(self._running) < cfg.max_num_seqs
            and (not preempted or not (prefill or decode))
        ):
            seq = self._waiting[0]
            chunk = self._admit(seq, budget)
            if chunk == 0:
                break
            prefill.append((seq, chunk))
            budget -= chunk
        if not prefill and not decode:
            return None
        return prefill, decode

    def _grow(self, seq: Seq) -> bool:
        """Make room for `seq`'s next token; False when the KV cache has no free block."""
        held = (len(seq.shared) + seq.private_blocks) * self.config.block_size
        if seq.prompt_tokens + seq.generated + 1 <= held:
            return True
        if self._used_blocks() + 1 > self.config.kv_blocks:
            return False
        seq.private_blocks += 1
        self._private_total += 1
        return True

    def _admit(self, seq: Seq, budget: int) -> int:
        """Move the head of the queue into a slot if its KV fits; return its first prefill
        chunk (0 when it does not fit)."""
        cfg = self.config
        tokens = seq.prefill_target
        hit = 0
        if cfg.prefix_cache:
            for h in seq.hashes:
                if h in self._in_use or h in self._cached:
                    hit += 1
                else:
                    break
            hit = min(hit, (tokens - 1) // cfg.block_size)  # always compute the last token
        shared = seq.hashes[:hit]
        private = self._blocks_for(tokens + 1) - hit
        revived = sum(1 for h in shared if h not in self._in_use)
        if self._used_blocks() + private + revived > cfg.kv_blocks:
            return 0
        self._waiting.popleft()
        for h in shared:
            self._in_use[h] = self._in_use.get(h, 0) + 1
            if h in self._cached:
                self._cached.move_to_end(h)
        seq.shared = shared
        seq.private_blocks = private
        self._private_total += private
        seq.prefilled = hit * cfg.block_size
        if cfg.prefix_cache:
            self._prefix_queries += tokens
            self._prefix_hits += seq.prefilled
        if seq.cached_tokens is None:
            seq.cached_tokens = seq.prefilled
        now = self._sim
        if seq.scheduled is None:
            seq.scheduled = now
            self._queue.observe(max(now - seq.arrival, 0.0))
        seq.state = RUNNING
        self._running.append(seq)
        return min(tokens - seq.prefilled, budget)

    def _release(self, seq: Seq) -> None:
        for h in seq.shared:
            left = self._in_use[h] - 1
            if left:
                self._in_use[h] = left
            else:
                del self._in_use[h]
        self._private_total -= seq.private_blocks
        seq.shared = ()
        seq.private_blocks = 0

    def _preempt(self, seq: Seq) -> None:
        self._running.remove(seq)
        self._release(seq)
        seq.state = WAITING
        seq.prefill_target = seq.prompt_tokens + seq.generated
        seq.prefilled = 0
        seq.preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(seq)

    def _abort(self, seq: Seq) -> None:
        if seq.state == RUNNING:
            self._running.remove(seq)
            self._release(seq)
        elif seq.state == WAITING:
            with contextlib.suppress(ValueError):
                self._waiting.remove(seq)
        else:
            return
        seq.state = DONE
        self._success["abort"] += 1
        if self._wake is not None:
            self._wake.set()

    def _cache_prompt(self, seq: Seq) -> None:
        """After prefill: the prompt's full blocks become shared cached blocks."""
        if not self.config.prefix_cache or len(seq.shared) >= len(seq.hashes):
            return
        for h in seq.hashes[len(seq.shared) :]:
            self._in_use[h] = self._in_use.get(h, 0) + 1
            self._cached[h] = None
            self._cached.move_to_end(h)
        moved = len(seq.hashes) - len(seq.shared)
        seq.private_blocks -= moved
        self._private_total -= moved
        seq.shared = seq.hashes
        while len(self._cached) > self.config.kv_blocks:
            self._cached.popitem(last=False)

    def _apply(self, prefill: list[tuple[Seq, int]], decode: list[Seq]) -> None:
        for seq, chunk in prefill:
            if seq.state != RUNNING:
                continue
            seq.prefilled += chunk
            self._prefill_computed += chunk
            if seq.prefilled >= seq.prefill_target:
                if not seq.prompt_counted:
                    seq.prompt_counted = True
                    self._prompt_tokens_total += seq.prompt_tokens
                self._cache_prompt(seq)
                self._emit(seq)
        for seq in decode:
            if seq.state == RUNNING:
                self._emit(seq)

    def _emit(self, seq: Seq) -> None:
        seq.generated += 1
        self._generation_tokens_total += 1
        now = self._sim
        if seq.first_token is None:
            seq.first_token = now
            self._ttft.observe(now - seq.arrival)
        if seq.generated < seq.target:
            return
        self._running.remove(seq)
        self._release(seq)
        seq.state = DONE
        self._success[seq.finish_reason] = self._success.get(seq.finish_reason, 0) + 1
        self._e2e.observe(now - seq.arrival)
        if not seq.future.done():
            seq.future.set_result(
                GenerationResult(
                    output_tokens=seq.generated,
                    finish_reason=seq.finish_reason,
                    cached_tokens=seq.cached_tokens or 0,
                    queue_s=(seq.scheduled or now) - seq.arrival,
                    ttft_s=seq.first_token - seq.arrival,
                    e2e_s=now - seq.arrival,
                    preemptions=seq.preemptions,
                )
            )
