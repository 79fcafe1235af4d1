"""Backend 'vllm': batch semantics over a pool of OpenAI-compatible servers (`vllm serve`, SGLang).

No server in the pool knows about batches: every stored request line's `body` is sent as one
`POST /v1/chat/completions` to one endpoint, and the pool gives the whole set batch semantics —
every request ends answered or as a `provider_error` row, exactly once, and results reach the
store in small groups as they arrive, so a killed run resumes with only the unanswered requests.

How requests are fed (`run_pool`):

- **Bounded, stocked queues.** Each endpoint has an in-flight cap. With `adaptive`, the cap
  follows the server's `/metrics` (polled every `metrics_interval_s`; see `next_cap`): the aim
  is a server running all it can with a small queue waiting (`headroom(running)`, about one
  step's worth of finishing sequences, so a freed slot is refilled from the server's own queue
  without a client round trip). The cap grows (doubling until the first shrink, polling four
  times as often meanwhile, then x1.125)
  while no more than that waits (`vllm:num_requests_waiting`) and the KV cache has room
  (`vllm:kv_cache_usage_perc` < `kv_grow_below`); it shrinks by the excess when more wait at
  two polls in a row. It
  never leaves [`min_inflight`, `max_inflight`]. A 503 (vLLM's answer when
  `--max-num-queued-reqs` is full) halves it. Without `adaptive` it stays at
  `initial_inflight`. Growth does not wait for the queue to be empty: requests that arrived
  since the server's current step began are always counted as waiting, so "grow only at zero"
  would hold the cap below the server's slots.
- **Bucketing**: requests go out longest first (by `est_input_tokens`, else line bytes / 4),
  so the long ones do not straggle at the end of the run.
- **Prefix grouping**: requests whose prompts start the same go to the same endpoint, so its
  prefix cache serves the shared part. The group key is the hash of the model, every message
  before the last user message (system prompt, few-shot turns: shared by all of a job's
  requests, so on its own it would put the whole job in one group) and the first
  `prefix_chars` characters of the last user message — equal there means a shared prefix of
  roughly `prefix_chars / 4` tokens beyond the fixed part (a template with a per-document or
  per-customer context before the row's own text). Groups are packed onto endpoints by
  estimated work (largest first, onto the least loaded); a group bigger than a quarter of an
  endpoint's share is cut into pieces, because every engine caches a prefix that common after
  its first request anyway. An endpoint that runs out of its own work takes requests from the
  back of the fullest other endpoint's queue, so no engine idles at the end.
- **Failover**: a refused or timed-out connection marks an endpoint down at once; a dropped
  connection, a read timeout or a 5xx triggers a `/health` probe that marks it down when it
  does not answer 200. A down endpoint's queued requests go to the others; its in-flight
  requests go back to the queue when they fail, or after `connect_timeout_s` if they hang. It
  is probed every `health_interval_s` and rejoins (cap back to `initial_inflight`) when healthy.
  A request is re-sent only when its response never arrived; one that arrived is never re-sent.
  When every endpoint stays down for `give_up_after_s`, the run stops with
  `TransientBackendError` after checkpointing what it has.
- **Errors**: 4xx answers become `provider_error` rows at once (401/403 stop the run: the key
  is wrong for every request). 408, 429, 5xx and transport errors are retried — on whichever
  endpoint is free, after an exponential backoff with jitter that honours `Retry-After` — up to
  `max_attempts` sends, then become `provider_error` rows. A connection that was refused is
  not counted as an attempt (the request never reached a server).

HTTP goes through httpx2, the HTTP stack the openai SDK ships (no further dependency), used
directly: the stored body is sent as it is, and the SDK's typed response objects would cost CPU
per request that a client feeding several engines at hundreds of requests per second needs
for itself. Chat requests are spread over small connection pools (see `_Endpoint`).

Retries are owned here, not by tenacity as elsewhere in lowtide: a retried request re-enters
the pool's queue so that it can move to another endpoint, which a wrap-the-call retry cannot
express; the HTTP client itself never retries.

Checkpointing: `checkpoint(frame)` receives RESULT_SCHEMA frames of `checkpoint_every` rows (the
last one smaller), one call at a time and in order, from a worker thread (the event loop keeps
feeding the engines while the store writes). If it raises, the run stops and re-raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx2
import orjson
import polars as pl

from lowtide.backends.base import (
    RESULT_SCHEMA,
    Capabilities,
    RequestStatus,
    TerminalBackendError,
    TransientBackendError,
)
from lowtide.jobspec import PoolSpec

CAPABILITIES = Capabilities(
    name="vllm",
    max_requests=50_000,  # requests per run_pool call (a "shard"); the servers set no limit
    max_bytes=200 * 1024 * 1024,
    structured_output="json_schema",
    wire="openai_chat",
    price_provider="vllm",  # priced by GPU time ([pool] gpu_hour_usd), not by the price table
)

ENV_URLS = "LOWTIDE_VLLM_URLS"
ENV_API_KEY = "LOWTIDE_VLLM_API_KEY"
CHAT_PATH = "/v1/chat/completions"
# Tags each request so the emulator's billing ledger can count executions per custom_id;
# real servers ignore it.
CUSTOM_ID_HEADER = "X-Lowtide-Custom-Id"

Checkpoint = Callable[[pl.DataFrame], None]


class PoolConfigError(TerminalBackendError):
    """The pool cannot be built from the job file and environment; the message says where."""

    def __init__(self, message: str):
        super().__init__(message, backend="vllm", operation="config")


# -- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolConfig:
    """Where the servers are and how to feed them. `urls` are OpenAI base URLs ending in /v1."""

    urls: tuple[str, ...]
    api_key: str | None = field(default=None, repr=False)  # never printed or logged
    min_inflight: int = 1
    max_inflight: int = 256
    initial_inflight: int = 8
    adaptive: bool = True
    bucketing: bool = True
    prefix_grouping: bool = True
    checkpoint_every: int = 200
    request_timeout_s: float = 600.0
    # Not in the job file: defaults that suit vLLM; tests and benches tune them.
    max_attempts: int = 5
    connect_timeout_s: float = 5.0
    metrics_interval_s: float = 0.5
    health_interval_s: float = 2.0
    give_up_after_s: float = 300.0
    prefix_chars: int = 256
    kv_grow_below: float = 0.90
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.urls:
            raise PoolConfigError("PoolConfig needs at least one endpoint URL")
        object.__setattr__(self, "urls", tuple(normalize_url(u) for u in self.urls))
        if len(set(self.urls)) != len(self.urls):
            raise PoolConfigError(f"the same vLLM endpoint is listed twice: {list(self.urls)}")
        if not 1 <= self.min_inflight <= self.max_inflight:
            raise PoolConfigError(
                f"[pool] min_inflight={self.min_inflight} must be at least 1 and at most "
                f"max_inflight={self.max_inflight}"
            )
        if self.checkpoint_every < 1 or self.max_attempts < 1:
            raise PoolConfigError("[pool] checkpoint_every and max_attempts must be at least 1")

    @property
    def start_cap(self) -> int:
        """`initial_inflight`, clamped into [min_inflight, max_inflight]."""
        return min(max(self.initial_inflight, self.min_inflight), self.max_inflight)

    @classmethod
    def from_spec(
        cls,
        spec: PoolSpec,
        env_urls: str | None = None,
        env_api_key: str | None = None,
        **overrides: Any,
    ) -> PoolConfig:
        """The pool for a job: endpoints from `LOWTIDE_VLLM_URLS` (comma-separated; pass
        `os.environ.get("LOWTIDE_VLLM_URLS")`) or else the job file's `[pool] urls`, the API
        key from `LOWTIDE_VLLM_API_KEY` (pass `os.environ.get(...)`) or else `[pool] api_key` —
        the environment wins, as everywhere in lowtide — plus the job file's feeding settings.
        `overrides` set any other field (tests, benches)."""
        urls: list[str] = []
        if env_urls and env_urls.strip():
            urls = [u.strip() for u in env_urls.split(",") if u.strip()]
        elif spec.urls:
            urls = list(spec.urls)
        if not urls:
            raise PoolConfigError(
                "No vLLM endpoints for backend 'vllm': set [pool] urls = "
                '["http://host:8000/v1", ...] in the job file or LOWTIDE_VLLM_URLS='
                "http://host:8000/v1,http://host2:8000/v1 in the environment "
                "(looked in: LOWTIDE_VLLM_URLS, job file [pool] urls)"
            )
        values: dict[str, Any] = {
            "urls": tuple(urls),
            "api_key": env_api_key or spec.api_key,
            "min_inflight": spec.min_inflight,
            "max_inflight": spec.max_inflight,
            "initial_inflight": spec.initial_inflight,
            "adaptive": spec.adaptive,
            "bucketing": spec.bucketing,
            "prefix_grouping": spec.prefix_grouping,
            "checkpoint_every": spec.checkpoint_every,
            "request_timeout_s": spec.request_timeout_s,
        }
        values.update(overrides)
        return cls(**values)

    def with_(self, **changes: Any) -> PoolConfig:
        return replace(self, **changes)


def normalize_url(url: str) -> str:
    """`http://host:8000`, `http://host:8000/` and `http://host:8000/v1/` all become
    `http://host:8000/v1`."""
    cleaned = url.strip().rstrip("/")
    if not cleaned.startswith(("http://", "https://")):
        raise PoolConfigError(
            f"vLLM endpoint {url!r} is not an http(s) URL; write it like http://host:8000/v1"
        )
    return cleaned if cleaned.endswith("/v1") else cleaned + "/v1"


# -- results and statistics ---------------------------------------------------------------------


@dataclass
class EndpointStats:
    url: str
    sent: int = 0
    answered: int = 0
    errors: int = 0
    failovers: int = 0  # times this endpoint was marked down
    requeued: int = 0  # requests sent here that went back to the queue
    mean_inflight: float = 0.0
    cap_history: list[tuple[float, int]] = field(default_factory=list)  # (seconds, cap)

    @property
    def cap_max(self) -> int:
        return max((c for _, c in self.cap_history), default=0)

    @property
    def cap_final(self) -> int:
        return self.cap_history[-1][1] if self.cap_history else 0


@dataclass
class PoolStats:
    """What one `run_pool` did. `answered + errors == requests` when it returns normally."""

    requests: int = 0
    answered: int = 0
    errors: int = 0
    failovers: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    mean_inflight: float = 0.0  # over the whole pool, time-weighted
    checkpoints: int = 0
    resent: list[str] = field(default_factory=list)  # sent again after a send with no answer
    per_endpoint: dict[str, EndpointStats] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def gpu_cost_usd(self, gpu_hour_usd: float, gpus: int) -> float:
        """What the run cost at `gpu_hour_usd` per GPU for `gpus` GPUs held for its wall time
        ([pool] gpu_hour_usd and gpus)."""
        return self.wall_s / 3600.0 * gpu_hour_usd * gpus

    def summary(self) -> dict[str, Any]:
        """Plain numbers for artifacts and logs."""
        return {
            "requests": self.requests,
            "answered": self.answered,
            "errors": self.errors,
            "failovers": self.failovers,
            "retries": self.retries,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "mean_inflight": round(self.mean_inflight, 1),
            "per_endpoint": {
                url: {
                    "sent": e.sent,
                    "answered": e.answered,
                    "errors": e.errors,
                    "failovers": e.failovers,
                    "mean_inflight": round(e.mean_inflight, 1),
                    "cap_max": e.cap_max,
                }
                for url, e in self.per_endpoint.items()
            },
        }


# -- pure parts: ordering, grouping, the cap controller, metrics ---------------------------------


def request_weights(requests: pl.DataFrame) -> list[int]:
    """Work estimate per request: `est_input_tokens` where given, else line bytes / 4."""
    by_bytes = pl.col("line").str.len_bytes() // 4
    if "est_input_tokens" in requests.columns:
        expr = pl.col("est_input_tokens").cast(pl.Int64).fill_null(by_bytes)
    else:
        expr = by_bytes
    return requests.select(expr.alias("w"))["w"].to_list()


def prefix_key(body: dict[str, Any], prefix_chars: int) -> str:
    """Group key of a chat body: model + messages before the last user message + the first
    `prefix_chars` characters of that message's text (see the module docstring)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ""
    last = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        if isinstance(messages[i], dict) and messages[i].get("role") == "user":
            last = i
            break
    content = messages[last].get("content") if isinstance(messages[last], dict) else None
    if isinstance(content, list):
        content = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    head = str(content or "")[:prefix_chars]
    material = orjson.dumps([body.get("model"), messages[:last], head], option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(material, digest_size=12).hexdigest()


def send_order(weights: Sequence[int], bucketing: bool) -> list[int]:
    """Indices in sending order: longest first with bucketing (stable), else input order."""
    order = list(range(len(weights)))
    if bucketing:
        order.sort(key=lambda i: -weights[i])
    return order


def assign_groups(
    keys: Sequence[str], weights: Sequence[int], n_endpoints: int, bucketing: bool
) -> list[list[int]]:
    """Per-endpoint sending order for prefix grouping.

    Requests with the same key stay on one endpoint, except that a group heavier than a
    quarter of an endpoint's fair share is cut into pieces of at most that weight. Pieces are
    packed largest first onto the least loaded endpoint. Each endpoint sends its pieces one
    after the other (a group's requests back to back, while its prefix is hot in the cache):
    with bucketing, pieces by their longest request and requests within a piece longest first;
    without, in input order."""
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    total = sum(max(w, 1) for w in weights)
    limit = max(total / (4 * max(n_endpoints, 1)), 1.0)
    pieces: list[list[int]] = []
    for members in groups.values():
        if bucketing:
            members = sorted(members, key=lambda i: -weights[i])
        piece: list[int] = []
        load = 0.0
        for i in members:
            if piece and load + max(weights[i], 1) > limit:
                pieces.append(piece)
                piece, load = [], 0.0
            piece.append(i)
            load += max(weights[i], 1)
        pieces.append(piece)
    piece_weight = [sum(max(weights[i], 1) for i in p) for p in pieces]
    heap = [(0.0, e) for e in range(n_endpoints)]
    owned: list[list[int]] = [[] for _ in range(n_endpoints)]
    for p in sorted(range(len(pieces)), key=lambda p: (-piece_weight[p], pieces[p][0])):
        load, e = heapq.heappop(heap)
        owned[e].append(p)
        heapq.heappush(heap, (load + piece_weight[p], e))
    out: list[list[int]] = []
    for plist in owned:
        if bucketing:
            plist.sort(key=lambda p: (-max(weights[i] for i in pieces[p]), pieces[p][0]))
        else:
            plist.sort(key=lambda p: pieces[p][0])
        out.append([i for p in plist for i in pieces[p]])
    return out


@dataclass(frozen=True)
class EngineLoad:
    """The three gauges the feeder reads from a server's /metrics."""

    running: float
    waiting: float
    kv_usage: float | None


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv",  # vLLM before the V1 metric names
}


def parse_metrics(text: str) -> EngineLoad | None:
    """Running/waiting summed over label sets (data-parallel ranks, models), KV usage as the
    fullest; None when the page has no vLLM gauges (not a vLLM server)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        kind = _GAUGES.get(name)
        if kind is None:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if kind == "kv":
            found[kind] = max(found.get(kind, 0.0), value)
        else:
            found[kind] = found.get(kind, 0.0) + value
    if "running" not in found and "waiting" not in found:
        return None
    return EngineLoad(found.get("running", 0.0), found.get("waiting", 0.0), found.get("kv"))


def headroom(running: float) -> float:
    """Waiting requests worth keeping on a server: about one step's worth of finishing
    sequences, so a freed slot is refilled from the server's own queue (at least 2)."""
    return max(2.0, 0.1 * running)


def next_cap(
    cap: float,
    load: EngineLoad,
    *,
    lo: int,
    hi: int,
    slow_start: bool,
    kv_grow_below: float = 0.90,
    previous: EngineLoad | None = None,
) -> tuple[float, bool]:
    """One step of the adaptive in-flight cap; returns (new cap, still in slow start).

    The target is a server running all it can with a small queue (`headroom(running)`)
    waiting. More waiting than that, now and at the `previous` reading (the caller passes one
    only when the queue has stayed above the headroom for a full polling interval): shrink by
    the smaller excess, but never below what the server runs plus the headroom, nor by more
    than half; this ends slow start. (One reading is not enough: a burst of long prompts keeps
    requests waiting for a few prefill steps although slots are free.) No more waiting than the
    headroom, KV cache room left, and the server holding (about) the cap already — requests
    still on their way or being tokenized say nothing yet about the server's room: grow, x2
    in slow start, else x1.125 (at least +1). An
    overshoot only lengthens the server's queue until the next polls, while an undershoot idles
    its slots, so growth is quick and the shrink is measured."""
    room = headroom(load.running)
    kv = load.kv_usage if load.kv_usage is not None else 0.0
    if load.waiting > room:
        if previous is not None and previous.waiting > headroom(previous.running):
            excess = min(load.waiting - room, previous.waiting - headroom(previous.running))
            cap = max(cap - excess, load.running + room, cap / 2)
            slow_start = False
    elif kv < kv_grow_below and load.running + load.waiting >= 0.9 * cap - 1:
        cap = max(cap * (2.0 if slow_start else 1.125), cap + 1)
    return float(min(max(cap, lo), hi)), slow_start


def backoff_delay(attempt: int, base: float, cap: float, retry_after: float | None) -> float:
    """Seconds before send number `attempt + 1`: the server's Retry-After when given (capped),
    else exponential with full jitter on the upper half."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), cap)
    ceiling = min(cap, base * 2 ** max(attempt - 1, 0))
    return ceiling / 2 + random.random() * ceiling / 2


def _retry_after(response: httpx2.Response) -> float | None:
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = response.headers.get(name)
        if value:
            try:
                return float(value) * scale
            except ValueError:
                continue
    return None


# -- the run ------------------------------------------------------------------------------------

_PENDING, _INFLIGHT, _DONE = 0, 1, 2
_CONNECTIONS_PER_POOL = 32
_RETRYABLE_STATUS = frozenset({408, 429})


class _Endpoint:
    def __init__(self, url: str, index: int, config: PoolConfig, started: float):
        self.url = url
        self.index = index
        self.root = url.removesuffix("/v1")
        self.up = False
        self.cap = float(config.start_cap)
        self.slow_start = True
        self.congested: tuple[float, EngineLoad] | None = None  # since when, first reading
        self.inflight = 0
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.queue: deque[int] = deque()
        self.wake = asyncio.Event()
        self.probing = False
        self.recovering = False
        self.down_reason = ""
        self.stats = EndpointStats(url=url)
        self.stats.cap_history.append((0.0, int(self.cap)))
        self.inflight_area = 0.0
        self.last_change = started
        # Chat requests are spread over several small connection pools: the HTTP client's pool
        # does work per pooled connection on every request, which a few hundred connections in
        # one pool turn into most of the client's CPU. /health and /metrics use their own.
        self.clients: list[httpx2.AsyncClient] = []
        self.active: list[int] = []
        self.control: httpx2.AsyncClient | None = None

    @property
    def cap_int(self) -> int:
        return max(int(self.cap), 1)


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
        self.state = [_PENDING] * self.n
        self.attempts = [0] * self.n
        self.maybe_executed: set[int] = set()  # a send reached a server, no answer came back
        self.done = 0
        self.rows: list[tuple[Any, ...]] = []
        self.retry: deque[int] = deque()  # failed-over and retried requests: sent first
        self.shared: deque[int] = deque()  # without prefix grouping, every endpoint's queue
        self.started = time.monotonic()
        self.endpoints = [_Endpoint(u, i, config, self.started) for i, u in enumerate(config.urls)]
        self.stats = PoolStats(requests=self.n)
        self.stats.per_endpoint = {ep.url: ep.stats for ep in self.endpoints}
        self.fatal: BaseException | None = None
        self.finished = asyncio.Event()
        self.all_down_since: float | None = None
        self.writes: asyncio.Queue[pl.DataFrame | None] = asyncio.Queue()
        self.total_inflight = 0
        self.total_area = 0.0
        self.total_last = self.started
        self.background: set[asyncio.Task[Any]] = set()

    # -- queues ---------------------------------------------------------------------------------

    def _fill_queues(self) -> None:
        up = [ep for ep in self.endpoints if ep.up]
        if self.config.prefix_grouping and len(up) > 1:
            keys = [self._key(i) for i in range(self.n)]
            for ep, order in zip(
                up, assign_groups(keys, self.weights, len(up), self.config.bucketing), strict=True
            ):
                ep.queue.extend(order)
        else:
            self.shared.extend(send_order(self.weights, self.config.bucketing))

    def _key(self, i: int) -> str:
        try:
            body = orjson.loads(self.lines[i]).get("body") or {}
        except (orjson.JSONDecodeError, AttributeError):
            return ""
        return prefix_key(body, self.config.prefix_chars) if isinstance(body, dict) else ""

    def _take(self, ep: _Endpoint) -> int | None:
        for source in (self.retry, ep.queue, self.shared):
            while source:
                i = source.popleft()
                if self.state[i] == _PENDING:
                    return i
        # Own work done: take from the back of the fullest queue (a down endpoint's first).
        victims = [e for e in self.endpoints if e is not ep and e.queue]
        if not victims:
            return None
        victim = max(victims, key=lambda e: (not e.up, len(e.queue)))
        while victim.queue:
            i = victim.queue.pop()
            if self.state[i] == _PENDING:
                return i
        return None

    def _requeue(self, i: int) -> None:
        if self.state[i] == _DONE:
            return
        self.state[i] = _PENDING
        self.retry.append(i)
        self._wake_all()

    def _wake_all(self) -> None:
        for ep in self.endpoints:
            ep.wake.set()

    # -- in-flight accounting -------------------------------------------------------------------

    def _count(self, ep: _Endpoint, delta: int) -> None:
        now = time.monotonic()
        ep.inflight_area += ep.inflight * (now - ep.last_change)
        ep.last_change = now
        ep.inflight += delta
        self.total_area += self.total_inflight * (now - self.total_last)
        self.total_last = now
        self.total_inflight += delta

    def _attach(self, ep: _Endpoint, i: int) -> None:
        self.state[i] = _INFLIGHT
        self.attempts[i] += 1
        ep.stats.sent += 1
        if i in self.maybe_executed:
            self.stats.resent.append(self.ids[i])
        self._count(ep, +1)
        task = asyncio.create_task(self._send(ep, i))
        ep.tasks[i] = task

    def _detach(self, ep: _Endpoint, i: int) -> bool:
        """Forget request i's send on ep; False when someone else already did (failover)."""
        if ep.tasks.pop(i, None) is None:
            return False
        self._count(ep, -1)
        ep.wake.set()
        return True

    def _set_cap(self, ep: _Endpoint, cap: float) -> None:
        old = ep.cap_int
        ep.cap = cap
        if ep.cap_int != old:
            ep.stats.cap_history.append((time.monotonic() - self.started, ep.cap_int))
            ep.wake.set()

    # -- outcomes -------------------------------------------------------------------------------

    def _record(self, i: int, row: tuple[Any, ...], answered: bool, ep: _Endpoint) -> None:
        if self.state[i] == _DONE:  # cannot happen: a request is attached to one send at a time
            return
        self.state[i] = _DONE
        self.done += 1
        if answered:
            self.stats.answered += 1
            ep.stats.answered += 1
        else:
            self.stats.errors += 1
            ep.stats.errors += 1
        self.rows.append((self.ids[i], *row))
        if len(self.rows) >= self.config.checkpoint_every:
            self._flush()
        if self.done == self.n:
            self.finished.set()
            self._wake_all()

    def _error_row(self, i: int, message: str, ep: _Endpoint) -> None:
        self._record(
            i,
            (RequestStatus.PROVIDER_ERROR.value, None, None, message, None, None, None),
            False,
            ep,
        )

    def _flush(self) -> None:
        if not self.rows:
            return
        frame = pl.DataFrame(self.rows, schema=RESULT_SCHEMA, orient="row")
        self.rows = []
        self.writes.put_nowait(frame)

    def _transient(self, ep: _Endpoint, i: int, reason: str, retry_after: float | None) -> None:
        """A send that may work later: back to the queue after a backoff, or an error row."""
        if self.attempts[i] >= self.config.max_attempts:
            self._error_row(i, f"{reason} (gave up after {self.attempts[i]} attempts)", ep)
            return
        self.stats.retries += 1
        delay = backoff_delay(
            self.attempts[i], self.config.backoff_s, self.config.backoff_max_s, retry_after
        )
        self.state[i] = _PENDING  # in no queue until the timer fires
        asyncio.get_running_loop().call_later(delay, self._requeue, i)

    # -- sending --------------------------------------------------------------------------------

    async def _send(self, ep: _Endpoint, i: int) -> None:
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
        k = min(range(len(ep.clients)), key=ep.active.__getitem__)
        ep.active[k] += 1
        try:
            response = await ep.clients[k].post(
                "/chat/completions",
                content=orjson.dumps(body),
                headers={CUSTOM_ID_HEADER: self.ids[i]},
            )
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
        finally:
            ep.active[k] -= 1
        if not self._detach(ep, i):
            return
        self._handle(ep, i, response)

    def _handle(self, ep: _Endpoint, i: int, response: httpx2.Response) -> None:
        status = response.status_code
        if status == 200:
            row = _answered_row(response.content)
            if row is None:
                self._error_row(i, f"HTTP 200 with an unreadable body from {ep.url}", ep)
                return
            self.stats.prompt_tokens += row[4] or 0
            self.stats.cached_tokens += row[5] or 0
            self.stats.output_tokens += row[6] or 0
            self._record(i, row, True, ep)
            return
        reason = f"HTTP {status} {_error_text(response)}"
        if status in (401, 403):
            self.fatal = TerminalBackendError(
                f"vLLM endpoint {ep.url} refused the API key ({reason}); set "
                f"{ENV_API_KEY} (or [pool] api_key in the job file) to the servers' --api-key",
                backend="vllm",
                operation="chat",
            )
            self.finished.set()
            self._wake_all()
            self.state[i] = _PENDING
            return
        if status in _RETRYABLE_STATUS or status >= 500:
            if status == 503 and self.config.adaptive:  # vLLM's queue is full
                self._set_cap(ep, max(float(self.config.min_inflight), ep.cap / 2))
                ep.slow_start = False
            if status >= 500:
                self._spawn(self._probe(ep))
            self._transient(ep, i, reason, _retry_after(response))
            return
        self._error_row(i, reason, ep)

    # -- endpoint health ------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _healthy(self, ep: _Endpoint) -> bool:
        assert ep.control is not None
        try:
            response = await ep.control.get(ep.root + "/health")
        except httpx2.TransportError:
            return False
        return response.status_code == 200

    async def _probe(self, ep: _Endpoint) -> None:
        if ep.probing or not ep.up:
            return
        ep.probing = True
        try:
            if not await self._healthy(ep):
                self._mark_down(ep, "/health did not answer 200")
        finally:
            ep.probing = False

    def _mark_down(self, ep: _Endpoint, reason: str) -> None:
        if not ep.up:
            return
        ep.up = False
        ep.stats.failovers += 1
        self.stats.failovers += 1
        ep.down_reason = reason
        # Its own queue goes to the others at once (kept in order, sent before new work).
        while ep.queue:
            i = ep.queue.popleft()
            if self.state[i] == _PENDING:
                self.retry.append(i)
        self._spawn(self._reclaim(ep, list(ep.tasks)))
        if not any(e.up for e in self.endpoints):
            self.all_down_since = time.monotonic()
        if not ep.recovering:
            self._spawn(self._recover(ep))
        self._wake_all()

    async def _reclaim(self, ep: _Endpoint, pending: list[int]) -> None:
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

    async def _recover(self, ep: _Endpoint) -> None:
        ep.recovering = True
        try:
            while not self.finished.is_set():
                await asyncio.sleep(self.config.health_interval_s)
                if await self._healthy(ep):
                    self._bring_up(ep)
                    return
        finally:
            ep.recovering = False

    def _bring_up(self, ep: _Endpoint) -> None:
        ep.up = True
        ep.slow_start = True
        ep.congested = None
        self._set_cap(ep, float(self.config.start_cap))
        self.all_down_since = None
        self._wake_all()

    async def _watch(self, ep: _Endpoint) -> None:
        """Adapt ep's cap from its /metrics while it is up."""
        assert ep.control is not None
        cfg = self.config
        while not self.finished.is_set():
            # Four times as often in slow start: reach a server's slot count within a second.
            await asyncio.sleep(cfg.metrics_interval_s / (4 if ep.slow_start else 1))
            if not ep.up:
                continue
            try:
                response = await ep.control.get(ep.root + "/metrics")
            except httpx2.TransportError:
                self._spawn(self._probe(ep))
                continue
            load = parse_metrics(response.text) if response.status_code == 200 else None
            if load is None or not ep.up:
                continue
            # A queue above the headroom must last a full interval before the cap shrinks
            # (slow start polls faster; a burst of long prompts clears within a few steps).
            now = time.monotonic()
            previous = None
            if load.waiting <= headroom(load.running):
                ep.congested = None
            elif ep.congested is None:
                ep.congested = (now, load)
            elif now - ep.congested[0] >= 0.9 * cfg.metrics_interval_s:
                previous = ep.congested[1]
                ep.congested = None
            cap, ep.slow_start = next_cap(
                ep.cap,
                load,
                lo=cfg.min_inflight,
                hi=cfg.max_inflight,
                slow_start=ep.slow_start,
                kv_grow_below=cfg.kv_grow_below,
                previous=previous,
            )
            # Growing only makes sense while the client keeps the current cap full.
            if cap > ep.cap and ep.inflight < ep.cap_int:
                continue
            self._set_cap(ep, cap)

    # -- feeding --------------------------------------------------------------------------------

    async def _feed(self, ep: _Endpoint) -> None:
        while not self.finished.is_set():
            if ep.up and ep.inflight < ep.cap_int:
                i = self._take(ep)
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
                    f"({', '.join(self.config.urls)}); {self.n - self.done} of {self.n} "
                    "requests are unanswered and will be sent by the next run",
                    backend="vllm",
                    operation="chat",
                )
                self.finished.set()
                self._wake_all()

    async def run(self) -> PoolStats:
        cfg = self.config
        timeout = httpx2.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s, pool=None)
        headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            headers["Authorization"] = f"Bearer {cfg.api_key}"
        per_pool = _CONNECTIONS_PER_POOL
        limits = httpx2.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
        control_timeout = httpx2.Timeout(cfg.connect_timeout_s)
        tls = httpx2.create_ssl_context()  # one for all clients: building one costs ~40 ms
        for ep in self.endpoints:
            ep.clients = [
                httpx2.AsyncClient(
                    base_url=ep.url, headers=headers, timeout=timeout, limits=limits, verify=tls
                )
                for _ in range(-(-cfg.max_inflight // per_pool))
            ]
            ep.active = [0] * len(ep.clients)
            ep.control = httpx2.AsyncClient(timeout=control_timeout, headers=headers, verify=tls)
        writer = asyncio.create_task(self._write())
        loops: list[asyncio.Task[None]] = []
        try:
            if self.n == 0:
                return self.stats
            healthy = await asyncio.gather(*(self._healthy(ep) for ep in self.endpoints))
            for ep, ok in zip(self.endpoints, healthy, strict=True):
                if ok:
                    ep.up = True
                else:
                    ep.stats.failovers += 1
                    self.stats.failovers += 1
                    self._spawn(self._recover(ep))
            if not any(healthy):
                self.all_down_since = time.monotonic()
            self._fill_queues()
            for ep in self.endpoints:
                loops.append(asyncio.create_task(self._feed(ep)))
                if cfg.adaptive:
                    loops.append(asyncio.create_task(self._watch(ep)))
            loops.append(asyncio.create_task(self._guard()))
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
                for client in [*ep.clients, ep.control]:
                    if client is not None:
                        await client.aclose()
        if writer.exception() is not None:
            raise writer.exception()  # type: ignore[misc]
        if self.fatal is not None:
            raise self.fatal
        return self.stats

    def _finish_stats(self) -> None:
        now = time.monotonic()
        wall = now - self.started
        self.stats.wall_s = wall
        self.total_area += self.total_inflight * (now - self.total_last)
        self.stats.mean_inflight = self.total_area / wall if wall > 0 else 0.0
        for ep in self.endpoints:
            area = ep.inflight_area + ep.inflight * (now - ep.last_change)
            ep.stats.mean_inflight = area / wall if wall > 0 else 0.0


def _error_text(response: httpx2.Response) -> str:
    """`<type or code>: <message>` from vLLM's / OpenAI's error envelope, else the raw body."""
    try:
        data = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code") or "error"
        return f"{kind}: {error.get('message', '')}"
    if isinstance(error, str):
        return error
    return response.text[:300]


def _answered_row(content: bytes) -> tuple[Any, ...] | None:
    """RESULT_SCHEMA values after custom_id for a 200 chat completion, or None if unreadable."""
    try:
        data = orjson.loads(content)
        choice = data["choices"][0]
        message = choice.get("message") or {}
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        return None
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    refusal = message.get("refusal")
    return (
        RequestStatus.ANSWERED.value,
        message.get("content"),
        choice.get("finish_reason"),
        f"refusal: {refusal}" if refusal else None,
        usage.get("prompt_tokens"),
        details.get("cached_tokens"),
        usage.get("completion_tokens"),
    )


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
        except BaseException as exc:  # handed to the calling thread below
            box["error"] = exc

    thread = threading.Thread(target=target, name="lowtide-vllm-pool")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["stats"]


# -- beyond one machine: `vllm run-batch` shards ------------------------------------------------


def write_run_batch_shards(
    requests: pl.DataFrame, out_dir: str | Path, shards: int, *, bucketing: bool = True
) -> list[Path]:
    """Write the stored request lines as `shard-<i>.jsonl` files for `vllm run-batch -i`
    (the lines are already its input format). Requests are dealt round-robin in sending order
    (longest first with `bucketing`), so every shard gets a like mix of lengths and the same
    work. Returns the paths, index order; empty shards are not written."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = requests["line"].to_list()
    order = send_order(request_weights(requests), bucketing)
    paths = []
    for k in range(shards):
        part = [lines[i] for i in order[k::shards]]
        if not part:
            break
        path = out / f"shard-{k}.jsonl"
        path.write_text("\n".join(part) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def run_batch_results(content: bytes) -> pl.DataFrame:
    """A `vllm run-batch` output file → RESULT_SCHEMA rows.

    run-batch writes OpenAI batch output lines, except that a failed request's `error` is
    either a string or vLLM's error envelope `{"error": {message, type, param, code}}` rather
    than OpenAI's `{code, message}` (provider-apis.md §3.2). Those are rewritten to OpenAI's
    shape (code = the envelope's type, or `run_batch_error` for a string) and the file is read
    by `openai_batch.parse_result_lines`. A run killed midway leaves a valid prefix: what is
    missing is simply not in the frame."""
    from lowtide.backends.openai_batch import parse_result_lines

    out: list[bytes] = []
    for raw in content.splitlines():
        if not raw.strip():
            continue
        line = orjson.loads(raw)
        error = line.get("error")
        if isinstance(error, str):
            line["error"] = {"code": "run_batch_error", "message": error}
        elif isinstance(error, dict) and isinstance(error.get("error"), dict):
            inner = error["error"]
            line["error"] = {
                "code": str(inner.get("type") or inner.get("code") or "run_batch_error"),
                "message": str(inner.get("message", "")),
            }
        out.append(orjson.dumps(line))
    return parse_result_lines(b"\n".join(out) + b"\n" if out else b"")
