"""Endpoints that follow a DNS name: `[pool] discover = "dns:NAME:PORT"`.

A Kubernetes headless Service answers a lookup of its name with one A/AAAA record per ready
pod, so resolving it gives the pool's current servers, and resolving it again later gives the
servers after the Deployment was scaled. Every address becomes the endpoint
`http://ADDRESS:PORT/v1` (an IPv6 address in brackets).

`Discovery.resolve` gives the current set of endpoint URLs, or None when the lookup failed: a
failed lookup (a DNS hiccup, a timeout) says nothing about the servers, so the caller keeps the
set it has rather than draining every engine. An answer with no addresses is an answer (the
Deployment was scaled to zero). The lookup runs on a worker thread, so the event loop keeps
feeding the engines while the resolver waits.

`follow` runs beside the run's feeders and applies each change (`apply`): a new address
joins like any endpoint, an address that is gone is drained.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lowtide.backends.vllm_pool.config import PoolConfig, Resolver
from lowtide.jobspec import parse_discover

if TYPE_CHECKING:
    from lowtide.backends.vllm_pool.runner import _PoolRun

log = logging.getLogger("lowtide.vllm_pool")


def resolve_addresses(name: str, port: int) -> list[str]:
    """Every address `name` resolves to (A and AAAA records, via the system resolver), once
    each, in a stable order (IPv4 before IPv6, numeric within each). Raises OSError
    (`socket.gaierror`) when the name cannot be resolved."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos}, key=_address_order)


def _address_order(address: str) -> tuple[int, int, str]:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # a scoped IPv6 address on an older Python, or something unexpected
        return (9, 0, address)
    return (ip.version, int(ip), address)


def endpoint_url(address: str, port: int) -> str:
    """`http://ADDRESS:PORT/v1`; an IPv6 address in brackets, its zone's `%` written `%25`."""
    host = f"[{address.replace('%', '%25')}]" if ":" in address else address
    return f"http://{host}:{port}/v1"


class Discovery:
    """The endpoint URLs behind `config.discover`, looked up with `config.resolver` (default:
    `resolve_addresses`)."""

    def __init__(self, config: PoolConfig) -> None:
        assert config.discover is not None
        self.spec = config.discover
        self.name, self.port = parse_discover(config.discover)
        self.resolver: Resolver = config.resolver or resolve_addresses
        self.interval_s = config.discover_interval_s

    async def resolve(self) -> list[str] | None:
        """The endpoint URLs the name resolves to now (in the resolver's order, no repeats),
        or None when the lookup failed (logged as a warning)."""
        try:
            addresses: Sequence[str] = await asyncio.to_thread(self.resolver, self.name, self.port)
        except OSError as exc:
            log.warning(
                "vllm pool: cannot resolve %s (%s); keeping the endpoints it had", self.spec, exc
            )
            return None
        return list(dict.fromkeys(endpoint_url(a, self.port) for a in addresses))


async def follow(run: _PoolRun, discovery: Discovery) -> None:
    """Re-resolve every `discovery.interval_s` until the run finishes and `apply` each answer;
    a failed lookup changes nothing."""
    while not run.finished.is_set():
        await asyncio.sleep(discovery.interval_s)
        urls = await discovery.resolve()
        if urls is not None and not run.finished.is_set():
            apply(run, urls)


def apply(run: _PoolRun, urls: Sequence[str]) -> None:
    """Make `urls` the run's serving endpoints.

    - A new URL joins: an endpoint with its own feeder and /metrics watch, brought up when its
      /health answers 200 (at once, then every `health_interval_s`), at the start cap — as an
      endpoint that recovers. It takes work from the retry queue, the shared queue and the
      back of the fullest other queue (`WorkQueues.take`).
    - A URL that is gone is drained: nothing new is sent to it and its queue goes to the
      others at once, but its in-flight requests are left to finish (a Deployment scaled down
      keeps the pod serving through its grace period). If its engine is really gone, they fail
      or hang as on any dead engine and go back to the queue — never lost, and one whose answer
      arrived is never sent again. While it still has requests in flight it gets a /health
      probe at every lookup, so a silent engine is taken down (and its requests reclaimed)
      without waiting for `request_timeout_s`.
    - A drained URL that is resolved again serves again (the same endpoint and statistics).
    """
    known = {ep.url: ep for ep in run.endpoints}
    for url in urls:
        ep = known.get(url)
        if ep is None:
            ep = run._add(url)
            run._start(ep)
            log.info("vllm pool: %s joins the pool (%s)", url, where(run))
        elif ep.draining:
            ep.draining = False
            ep.stats.drained_after = None
            log.info("vllm pool: %s is resolved again; it serves again", url)
        else:
            continue
        if ep.up:
            run.all_down_since = None
            run._wake_all()
        elif not ep.recovering:
            run._spawn(run._recover(ep, wait=False))
    for ep in run.endpoints:
        if ep.url in urls:
            continue
        if not ep.draining:
            ep.draining = True
            ep.stats.drained_after = ep.stats.sent
            ep.stats.drains += 1
            run.work.evacuate(ep)
            run._serving_or_none()
            run._wake_all()
            log.info("vllm pool: %s is no longer resolved; draining it", ep.url)
        if ep.tasks and ep.up:
            run._spawn(run._probe(ep))


def where(run: _PoolRun) -> str:
    """The serving endpoints for messages, with the name they came from."""
    urls = ", ".join(ep.url for ep in run.endpoints if not ep.draining) or "none"
    return f"{run.discovery.spec} resolving to {urls}" if run.discovery else urls
