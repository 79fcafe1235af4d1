"""The pool's control law: every decision the runner makes from numbers it already holds.

Which request goes first and to which endpoint, what a server's /metrics say about its load,
how far the in-flight cap moves on each reading, what an HTTP status means for the request,
how long to wait before a retry. No asyncio, no I/O, no clock: times and random draws are
passed in, so each rule is a table test (tests/backends/test_vllm_control.py).
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson
import polars as pl

from lowtide.backends.vllm_pool.config import PoolConfig
from lowtide.backends.wire import is_transient_status

# -- ordering and placement ---------------------------------------------------------------------


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
    `prefix_chars` characters of that message's text (see the package docstring)."""
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


# -- reading a server's load and steering the in-flight cap -------------------------------------


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


@dataclass(frozen=True)
class CapControl:
    """One endpoint's cap controller between two /metrics readings: the cap, whether it is
    still in slow start (doubling, polled four times as often), and the first reading of a
    queue above the headroom that has not yet lasted a full polling interval (with its time)."""

    cap: float
    slow_start: bool = True
    congested: tuple[float, EngineLoad] | None = None

    @property
    def cap_int(self) -> int:
        """The cap as a request count: at least 1."""
        return max(int(self.cap), 1)


def poll_interval(control: CapControl, interval_s: float) -> float:
    """Seconds until the next /metrics reading: a quarter of `interval_s` in slow start, so
    the cap reaches a server's slot count within about a second."""
    return interval_s / 4 if control.slow_start else interval_s


def on_metrics(
    control: CapControl, load: EngineLoad, *, now: float, inflight: int, config: PoolConfig
) -> CapControl:
    """The controller after one /metrics reading `load` taken at `now` (monotonic seconds),
    with `inflight` requests of ours on the server.

    A queue above the headroom counts as sustained (and is handed to `next_cap` as
    `previous`) once it has lasted 0.9 of `metrics_interval_s`: slow start polls faster, and
    a burst of long prompts clears within a few steps. A grown cap is taken only while our
    in-flight count fills the current one: otherwise the server's room says nothing about a
    bigger cap."""
    previous = None
    congested = control.congested
    if load.waiting <= headroom(load.running):
        congested = None
    elif congested is None:
        congested = (now, load)
    elif now - congested[0] >= 0.9 * config.metrics_interval_s:
        previous = congested[1]
        congested = None
    cap, slow_start = next_cap(
        control.cap,
        load,
        lo=config.min_inflight,
        hi=config.max_inflight,
        slow_start=control.slow_start,
        kv_grow_below=config.kv_grow_below,
        previous=previous,
    )
    if cap > control.cap and inflight < control.cap_int:
        cap = control.cap
    return CapControl(cap, slow_start, congested)


def on_overload(control: CapControl, lo: int) -> CapControl:
    """After a 503 (vLLM's answer when `--max-num-queued-reqs` is full): the cap halves,
    never below `lo`, and slow start ends."""
    return replace(control, cap=max(float(lo), control.cap / 2), slow_start=False)


# -- what an answer means, and when to try again ------------------------------------------------


class Verdict(enum.Enum):
    """What the pool does with one HTTP answer."""

    ANSWERED = "answered"  # a result row
    KEY_REFUSED = "key_refused"  # 401/403: the key is wrong for every request, stop the run
    RETRY = "retry"  # may work later, on any endpoint
    FAILED = "failed"  # a provider_error row at once


def verdict(status_code: int) -> Verdict:
    """HTTP status → what happens to the request (transient per `wire.is_transient_status`)."""
    if status_code == 200:
        return Verdict.ANSWERED
    if status_code in (401, 403):
        return Verdict.KEY_REFUSED
    if is_transient_status(status_code):
        return Verdict.RETRY
    return Verdict.FAILED


def backoff_delay(
    attempt: int,
    base: float,
    cap: float,
    retry_after: float | None,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds before send number `attempt + 1`: the server's Retry-After when given (capped
    at `cap`, never negative), else exponential from `base` (x2 per attempt, at most `cap`)
    with full jitter on the upper half; `rand` draws from [0, 1)."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), cap)
    ceiling = min(cap, base * 2 ** max(attempt - 1, 0))
    return ceiling / 2 + rand() * ceiling / 2
