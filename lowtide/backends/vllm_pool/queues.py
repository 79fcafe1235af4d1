"""Which request is where: a state per request and the queues the feeders take from.

Plain bookkeeping, no asyncio: the runner decides when; this decides which request is next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import orjson

from lowtide.backends.vllm_pool.config import PoolConfig
from lowtide.backends.vllm_pool.control import assign_groups, prefix_key, send_order
from lowtide.backends.vllm_pool.endpoint import Endpoint

PENDING, INFLIGHT, DONE = 0, 1, 2


class WorkQueues:
    """Every request is PENDING (in a queue, or waiting out a backoff), INFLIGHT (attached to
    one send) or DONE (its row recorded). A feeder takes, in this order: retried and
    failed-over requests, its endpoint's own queue (prefix grouping), the shared queue (no
    grouping), and last the back of the fullest other queue, so no engine idles at the end.
    Entries that are no longer PENDING are skipped when met, never searched for."""

    def __init__(self, lines: Sequence[str], weights: Sequence[int], config: PoolConfig):
        self.lines = lines
        self.weights = weights
        self.config = config
        self.state = [PENDING] * len(lines)
        self.retry: deque[int] = deque()  # failed-over and retried requests: sent first
        self.shared: deque[int] = deque()  # without prefix grouping, every endpoint's queue

    def fill(self, up: list[Endpoint]) -> None:
        """Queue every request: per endpoint by prefix group when grouping over more than one
        endpoint that is up, else in one shared queue, in sending order either way."""
        cfg = self.config
        if cfg.prefix_grouping and len(up) > 1:
            keys = [self._key(i) for i in range(len(self.lines))]
            orders = assign_groups(keys, self.weights, len(up), cfg.bucketing)
            for ep, order in zip(up, orders, strict=True):
                ep.queue.extend(order)
        else:
            self.shared.extend(send_order(self.weights, cfg.bucketing))

    def _key(self, i: int) -> str:
        try:
            body = orjson.loads(self.lines[i]).get("body") or {}
        except (orjson.JSONDecodeError, AttributeError):
            return ""
        return prefix_key(body, self.config.prefix_chars) if isinstance(body, dict) else ""

    def take(self, ep: Endpoint, endpoints: Sequence[Endpoint]) -> int | None:
        """The next PENDING request for `ep`, or None when there is none anywhere."""
        for source in (self.retry, ep.queue, self.shared):
            while source:
                i = source.popleft()
                if self.state[i] == PENDING:
                    return i
        # Own work done: take from the back of the fullest queue (a down endpoint's first).
        victims = [e for e in endpoints if e is not ep and e.queue]
        if not victims:
            return None
        victim = max(victims, key=lambda e: (not e.up, len(e.queue)))
        while victim.queue:
            i = victim.queue.pop()
            if self.state[i] == PENDING:
                return i
        return None

    def requeue(self, i: int) -> bool:
        """Put request i at the back of the retry queue; False when it is already DONE."""
        if self.state[i] == DONE:
            return False
        self.state[i] = PENDING
        self.retry.append(i)
        return True

    def evacuate(self, ep: Endpoint) -> None:
        """A down endpoint's queue moves to the retry queue at once, kept in order, so the
        others send it before new work."""
        while ep.queue:
            i = ep.queue.popleft()
            if self.state[i] == PENDING:
                self.retry.append(i)
