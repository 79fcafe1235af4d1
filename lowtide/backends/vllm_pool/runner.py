"""The asyncio side of the pool: feeding endpoints, sending, failover, checkpoint writes.

Every decision with numbers in it is made by `control`; this module owns the event loop, the
HTTP calls, the timers and the bookkeeping of which request is where.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx2
import orjson
import polars as pl

from lowtide.backends.base import (
    RESULT_SCHEMA,
    RequestStatus,
    TransientBackendError,
)
from lowtide.backends.vllm_pool.config import CHAT_PATH, CUSTOM_ID_HEADER, ENV_API_KEY, PoolConfig
from lowtide.backends.vllm_pool.control import (
    CapControl,
    Verdict,
    backoff_delay,
    on_metrics,
    on_overload,
    parse_metrics,
    poll_interval,
    request_weights,
    verdict,
)
from lowtide.backends.vllm_pool.discovery import Discovery, follow, where
from lowtide.backends.vllm_pool.endpoint import Endpoint, answered_row, error_text
from lowtide.backends.vllm_pool.queues import DONE, INFLIGHT, PENDING, WorkQueues
from lowtide.backends.vllm_pool.stats import InflightMeter, PoolStats
from lowtide.backends.wire import retry_after_s
from lowtide.errors import CredentialsError, scrub

Checkpoint = Callable[[pl.DataFrame], None]

HEALTH_FAILURES_TO_DOWN = 2
"""Consecutive failed /health probes before an endpoint is taken down."""


class _PoolRun:
    def __init__(self, requests: pl.DataFrame, config: PoolConfig, checkpoint: Checkpoint):
        missing = {"custom_id", "line"} - set(requests.columns)
        if missing:
            raise ValueError(
                f"run_pool needs columns custom_id and line; missing {sorted(missing)}"
            )
        self.config = config
        self.checkpoint = checkpoint
        self.ids: list[str] = requests["custom_id"].to_list()
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("run_pool got duplicate custom_ids; each request must appear once")
        self.lines: list[str] = requests["line"].to_list()
        self.weights = request_weights(requests)
        self.n = len(self.ids)
        self.work = WorkQueues(self.lines, self.weights, config)
        self.state = self.work.state  # PENDING / INFLIGHT / DONE per request
        self.attempts = [0] * self.n
        self.maybe_executed: set[int] = set()  # a send reached a server, no answer came back
        self.done = 0
        self.rows: list[tuple[Any, ...]] = []
        self.started = time.monotonic()
        self.stats = PoolStats(requests=self.n)
        self.endpoints: list[Endpoint] = []
        self.discovery = Discovery(config) if config.discover else None
        self.headers = {"Content-Type": "application/json"}
        if config.api_key:
            self.headers["Authorization"] = f"Bearer {config.api_key}"
        self.tls = httpx2.create_ssl_context()  # one for all clients: building one costs ~40 ms
        self.loops: list[asyncio.Task[None]] = []
        self.fatal: BaseException | None = None
        self.finished = asyncio.Event()
        self.all_down_since: float | None = None
        self.writes: asyncio.Queue[pl.DataFrame | None] = asyncio.Queue()
        self.meter = InflightMeter(self.started)  # the whole pool's in-flight count
        self.background: set[asyncio.Task[Any]] = set()

    # -- queues ---------------------------------------------------------------------------------

    def _requeue(self, i: int) -> None:
        if self.work.requeue(i):
            self._wake_all()

    def _wake_all(self) -> None:
        for ep in self.endpoints:
            ep.wake.set()

    def _serving_or_none(self) -> None:
        """Start the give-up clock when no endpoint is serving (up and not draining)."""
        if self.all_down_since is None and not any(e.serving for e in self.endpoints):
            self.all_down_since = time.monotonic()

    # -- in-flight accounting -------------------------------------------------------------------

    def _count(self, ep: Endpoint, delta: int) -> None:
        now = time.monotonic()
        ep.meter.add(now, delta)
        self.meter.add(now, delta)

    def _attach(self, ep: Endpoint, i: int) -> None:
        self.state[i] = INFLIGHT
        self.attempts[i] += 1
        ep.stats.sent += 1
        if i in self.maybe_executed:
            self.stats.resent.append(self.ids[i])
        self._count(ep, +1)
        task = asyncio.create_task(self._send(ep, i))
        ep.tasks[i] = task

    def _detach(self, ep: Endpoint, i: int) -> bool:
        """Forget request i's send on ep; False when someone else already did (failover)."""
        if ep.tasks.pop(i, None) is None:
            return False
        self._count(ep, -1)
        ep.wake.set()
        return True

    def _steer(self, ep: Endpoint, control: CapControl) -> None:
        """Adopt the controller's new state; a changed cap is recorded and may free a slot."""
        old = ep.cap_int
        ep.control = control
        if ep.cap_int != old:
            ep.stats.cap_history.append((time.monotonic() - self.started, ep.cap_int))
            ep.wake.set()

    # -- outcomes -------------------------------------------------------------------------------

    def _record(self, i: int, row: tuple[Any, ...], answered: bool, ep: Endpoint) -> None:
        """Request i is done with `row` (a full RESULT_SCHEMA tuple, custom_id first)."""
        if self.state[i] == DONE:  # cannot happen: a request is attached to one send at a time
            return
        self.state[i] = DONE
        self.done += 1
        if answered:
            self.stats.answered += 1
            ep.stats.answered += 1
        else:
            self.stats.errors += 1
            ep.stats.errors += 1
        self.rows.append(row)
        if len(self.rows) >= self.config.checkpoint_every:
            self._flush()
        if self.done == self.n:
            self.finished.set()
            self._wake_all()

    def _error_row(self, i: int, message: str, ep: Endpoint) -> None:
        error = RequestStatus.PROVIDER_ERROR.value
        row = (self.ids[i], error, None, None, message, None, None, None, False)
        self._record(i, row, False, ep)

    def _flush(self) -> None:
        if not self.rows:
            return
        frame = pl.DataFrame(self.rows, schema=RESULT_SCHEMA, orient="row")
        self.rows = []
        self.writes.put_nowait(frame)

    def _transient(self, ep: Endpoint, i: int, reason: str, retry_after: float | None) -> None:
        """A send that may work later: back to the queue after a backoff, or an error row."""
        if self.attempts[i] >= self.config.max_attempts:
            self._error_row(i, f"{reason} (gave up after {self.attempts[i]} attempts)", ep)
            return
        self.stats.retries += 1
        delay = backoff_delay(
            self.attempts[i], self.config.backoff_s, self.config.backoff_max_s, retry_after
        )
        self.state[i] = PENDING  # in no queue until the timer fires
        asyncio.get_running_loop().call_later(delay, self._requeue, i)

    # -- sending --------------------------------------------------------------------------------

    async def _send(self, ep: Endpoint, i: int) -> None:
        try:
            line = orjson.loads(self.lines[i])
            url = line.get("url", CHAT_PATH)
            body = line.get("body")
        except (orjson.JSONDecodeError, AttributeError) as exc:
            if self._detach(ep, i):
                self._error_row(i, f"request line is not a JSON object: {exc}", ep)
            return
        if url != CHAT_PATH or not isinstance(body, dict):
            if self._detach(ep, i):
                self._error_row(
                    i,
                    f"url {url!r} is not supported by the vllm pool backend "
                    f"(only {CHAT_PATH} with a JSON body)",
                    ep,
                )
            return
        try:
            response = await ep.post(body, {CUSTOM_ID_HEADER: self.ids[i]})
        except asyncio.CancelledError:
            return  # failover took it back (it hung on a down endpoint)
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            if self._detach(ep, i):
                self.attempts[i] -= 1  # never reached a server
                ep.stats.requeued += 1
                self._requeue(i)
            self._mark_down(ep, f"connection failed: {exc!r}")
            return
        except httpx2.TransportError as exc:
            if self._detach(ep, i):
                ep.stats.requeued += 1
                self.maybe_executed.add(i)
                self._transient(ep, i, f"{ep.url}: {type(exc).__name__}: {exc}", None)
            self._spawn(self._probe(ep))
            return
        if not self._detach(ep, i):
            return
        self._handle(ep, i, response)

    def _handle(self, ep: Endpoint, i: int, response: httpx2.Response) -> None:
        status = response.status_code
        outcome = verdict(status)
        if outcome is Verdict.ANSWERED:
            row = answered_row(self.ids[i], response.content)
            if row is None:
                self._error_row(i, f"HTTP 200 with an unreadable body from {ep.url}", ep)
                return
            self.stats.prompt_tokens += row[5] or 0
            self.stats.cached_tokens += row[6] or 0
            self.stats.output_tokens += row[7] or 0
            self._record(i, row, True, ep)
            return
        reason = f"HTTP {status} {error_text(response)}"
        if outcome is Verdict.KEY_REFUSED:
            self.fatal = CredentialsError(  # the run stays resumable: nothing failed for it
                f"vLLM endpoint {ep.url} refused the API key "
                f"({scrub(reason, self.config.api_key)}); set "
                f"{ENV_API_KEY} (or [pool] api_key in the job file) to the servers' --api-key",
                backend="vllm",
                operation="chat",
            )
            self.finished.set()
            self._wake_all()
            self.state[i] = PENDING
            return
        if outcome is Verdict.RETRY:
            if status == 503 and self.config.adaptive:  # vLLM's queue is full
                self._steer(ep, on_overload(ep.control, self.config.min_inflight))
            if status >= 500:  # the server itself may be failing
                self._spawn(self._probe(ep))
            self._transient(ep, i, reason, retry_after_s(response.headers))
            return
        self._error_row(i, reason, ep)

    # -- endpoint health ------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _probe(self, ep: Endpoint) -> None:
        if ep.probing or not ep.up:
            return
        ep.probing = True
        try:
            # one slow /health is not a dead server (a busy engine, or one holding its GIL while
            # it loads a tokenizer): only a second failure, a health interval later, takes it
            # down, since taking it down re-queues its in-flight requests, which then run twice
            for attempt in range(HEALTH_FAILURES_TO_DOWN):
                if await ep.healthy():
                    return
                if attempt + 1 < HEALTH_FAILURES_TO_DOWN:
                    await asyncio.sleep(self.config.health_interval_s)
            self._mark_down(ep, f"/health did not answer 200 {HEALTH_FAILURES_TO_DOWN} times")
        finally:
            ep.probing = False

    def _mark_down(self, ep: Endpoint, reason: str) -> None:
        if not ep.up:
            return
        ep.up = False
        ep.stats.failovers += 1
        self.stats.failovers += 1
        ep.down_reason = reason
        self.work.evacuate(ep)
        self._spawn(self._reclaim(ep, list(ep.tasks)))
        self._serving_or_none()
        if not ep.recovering:
            self._spawn(self._recover(ep))
        self._wake_all()

    async def _reclaim(self, ep: Endpoint, pending: list[int]) -> None:
        """In-flight sends on a down endpoint that neither answer nor fail (a hung server) go
        back to the queue after `connect_timeout_s`."""
        await asyncio.sleep(self.config.connect_timeout_s)
        for i in pending:
            task = ep.tasks.get(i)
            if task is not None and not ep.up and self._detach(ep, i):
                task.cancel()
                ep.stats.requeued += 1
                self.maybe_executed.add(i)
                self._requeue(i)

    async def _recover(self, ep: Endpoint, wait: bool = True) -> None:
        """Probe a down endpoint every `health_interval_s` (the first at once unless `wait`)
        and bring it up when healthy; a draining endpoint is not brought back."""
        ep.recovering = True
        try:
            while not self.finished.is_set() and not ep.draining:
                if wait:
                    await asyncio.sleep(self.config.health_interval_s)
                wait = True
                if await ep.healthy() and not ep.draining:
                    self._bring_up(ep)
                    return
        finally:
            ep.recovering = False

    def _bring_up(self, ep: Endpoint) -> None:
        ep.up = True
        self._steer(ep, CapControl(float(self.config.start_cap)))  # slow start again
        self.all_down_since = None
        self._wake_all()

    async def _watch(self, ep: Endpoint) -> None:
        """Adapt ep's cap from its /metrics while it is up and not draining."""
        assert ep.http is not None
        cfg = self.config
        while not self.finished.is_set():
            await asyncio.sleep(poll_interval(ep.control, cfg.metrics_interval_s))
            if not ep.serving:
                continue
            try:
                response = await ep.http.get(ep.root + "/metrics")
            except httpx2.TransportError:
                self._spawn(self._probe(ep))
                continue
            load = parse_metrics(response.text) if response.status_code == 200 else None
            if load is None or not ep.up:
                continue
            now = time.monotonic()
            self._steer(ep, on_metrics(ep.control, load, now=now, inflight=ep.inflight, config=cfg))

    # -- membership: what `run` starts with, and what `discovery.follow` adds ----------------------

    def _add(self, url: str) -> Endpoint:
        ep = Endpoint(url, len(self.endpoints), self.config, self.started)
        ep.open(self.config, self.headers, self.tls)
        self.endpoints.append(ep)
        self.stats.per_endpoint[url] = ep.stats
        return ep

    def _start(self, ep: Endpoint) -> None:
        self.loops.append(asyncio.create_task(self._feed(ep)))
        if self.config.adaptive:
            self.loops.append(asyncio.create_task(self._watch(ep)))

    # -- feeding --------------------------------------------------------------------------------

    async def _feed(self, ep: Endpoint) -> None:
        while not self.finished.is_set():
            if ep.serving and ep.inflight < ep.cap_int:
                i = self.work.take(ep, self.endpoints)
                if i is not None:
                    self._attach(ep, i)
                    continue
            ep.wake.clear()
            await ep.wake.wait()

    async def _write(self) -> None:
        while True:
            frame = await self.writes.get()
            if frame is None:
                return
            await asyncio.to_thread(self.checkpoint, frame)
            self.stats.checkpoints += 1

    async def _guard(self) -> None:
        """Stop the run when every endpoint has been down for `give_up_after_s`."""
        while not self.finished.is_set():
            await asyncio.sleep(min(1.0, self.config.give_up_after_s / 4))
            since = self.all_down_since
            if since is not None and time.monotonic() - since >= self.config.give_up_after_s:
                self.fatal = TransientBackendError(
                    f"every vLLM endpoint has been down for {self.config.give_up_after_s:g} s "
                    f"({where(self)}); {self.n - self.done} of {self.n} "
                    "requests are unanswered and will be sent by the next run",
                    backend="vllm",
                    operation="chat",
                )
                self.finished.set()
                self._wake_all()

    async def run(self) -> PoolStats:
        for url in self.config.urls:
            self._add(url)
        writer = asyncio.create_task(self._write())
        loops = self.loops
        try:
            if self.n == 0:
                return self.stats
            if self.discovery is not None:
                for url in await self.discovery.resolve() or ():
                    self._add(url)
            healthy = await asyncio.gather(*(ep.healthy() for ep in self.endpoints))
            for ep, ok in zip(self.endpoints, healthy, strict=True):
                if ok:
                    ep.up = True
                else:
                    ep.stats.failovers += 1
                    self.stats.failovers += 1
                    self._spawn(self._recover(ep))
            self._serving_or_none()
            self.work.fill([ep for ep in self.endpoints if ep.up])
            for ep in self.endpoints:
                self._start(ep)
            loops.append(asyncio.create_task(self._guard()))
            if self.discovery is not None:
                loops.append(asyncio.create_task(follow(self, self.discovery)))
            finished = asyncio.create_task(self.finished.wait())
            await asyncio.wait({finished, writer}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and writer.exception() is not None:
                self.fatal = writer.exception()
            finished.cancel()
        finally:
            self.finished.set()
            for task in loops + list(self.background):
                task.cancel()
            for ep in self.endpoints:
                for task in ep.tasks.values():
                    task.cancel()
            await asyncio.gather(*loops, *self.background, return_exceptions=True)
            await asyncio.gather(
                *(t for ep in self.endpoints for t in ep.tasks.values()), return_exceptions=True
            )
            self._finish_stats()
            if not writer.done():
                self._flush()
                self.writes.put_nowait(None)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(writer)
            for ep in self.endpoints:
                await ep.aclose()
        if writer.exception() is not None:
            raise writer.exception()  # type: ignore[misc]
        if self.fatal is not None:
            raise self.fatal
        return self.stats

    def _finish_stats(self) -> None:
        now = time.monotonic()
        self.stats.wall_s = now - self.started
        self.stats.mean_inflight = self.meter.mean(now)
        for ep in self.endpoints:
            ep.stats.mean_inflight = ep.meter.mean(now)


async def run_pool_async(
    requests: pl.DataFrame, config: PoolConfig, checkpoint: Checkpoint
) -> PoolStats:
    """`run_pool` for callers already inside an event loop."""
    return await _PoolRun(requests, config, checkpoint).run()


def run_pool(requests: pl.DataFrame, config: PoolConfig, checkpoint: Checkpoint) -> PoolStats:
    """Send every request (columns `custom_id`, `line`: a stored batch line, optional
    `est_input_tokens`) to the pool; hand every result to `checkpoint` as RESULT_SCHEMA frames
    in groups of `config.checkpoint_every`; return the run's statistics.

    Contract: on a normal return every custom_id was handed to `checkpoint` exactly once,
    `answered` or `provider_error`. If it raises (every endpoint down for `give_up_after_s`,
    a rejected API key, a failing `checkpoint`), what was answered before has been handed over
    and the rest was not: the next run sends only those. Safe to call from inside a running
    event loop (it then runs on a private thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_pool_async(requests, config, checkpoint))
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["stats"] = asyncio.run(run_pool_async(requests, config, checkpoint))
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread below
            box["error"] = exc

    thread = threading.Thread(target=target, name="lowtide-vllm-pool")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["stats"]
