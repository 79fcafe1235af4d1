"""`[pool] discover = "dns:NAME:PORT"`: the pool follows what a name resolves to, mid-run.

A Kubernetes headless Service is one name, one port and an address per ready pod. Linux routes
all of 127.0.0.0/8 to loopback, so emulated engines on 127.0.0.2, 127.0.0.3, ... listening on
one port have exactly that shape; the test's resolver (the `PoolConfig.resolver` seam) says
which of them the name resolves to, and the tests change that while the pool runs. Each engine
has its own billing ledger, so what every engine executed is known from the engine's side.

Changes are made on events (results committed, executions seen on an engine, the pool having
looked the name up again), never after a delay, and nothing asserts on wall-clock time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from lowtide.backends.base import RESULT_SCHEMA
from lowtide.backends.vllm_pool import PoolConfig, PoolConfigError, run_pool
from lowtide.backends.vllm_pool.discovery import endpoint_url, resolve_addresses
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.vllm_pool import EnginePool, start_engines
from lowtide.errors import JobFileError
from lowtide.jobspec import PoolSpec, load_job
from lowtide.tokens import count_tokens
from tests.backends.test_vllm_pool import FAST, make_requests
from tests.waiting import wait_for_event, wait_until

NAME = "vllm-headless.default.svc.cluster.local"


@pytest.fixture(scope="module", autouse=True)
def _tokenizer_loaded() -> None:
    count_tokens("warm up")  # the emulated model counts tokens: load the vocabulary up front


class Names:
    """What NAME resolves to, as the pool is told through `PoolConfig.resolver` (called on the
    pool's worker thread). `applied` is set once the pool has asked again after receiving the
    latest answer: the pool applies an answer before it asks again, so by then it has acted."""

    def __init__(self, addresses: list[str], port: int) -> None:
        self.port = port
        self.lock = threading.Lock()
        self.addresses = list(addresses)
        self.version = 0
        self.returned = -1
        self.failing = False
        self.failures = 0
        self.applied = threading.Event()

    def set(self, addresses: list[str]) -> None:
        with self.lock:
            self.addresses = list(addresses)
            self.version += 1
            self.applied.clear()

    def __call__(self, name: str, port: int) -> list[str]:
        assert (name, port) == (NAME, self.port)
        with self.lock:
            if self.failing:
                self.failures += 1
                raise OSError(f"[Errno -3] Temporary failure in name resolution ({name})")
            if self.returned == self.version:
                self.applied.set()
            self.returned = self.version
            return list(self.addresses)


class Cluster:
    """Emulated engines on 127.0.0.2, 127.0.0.3, ... sharing one port, each with its own
    ledger; `url(k)` is what the pool calls engine k."""

    def __init__(self, n: int, configs: dict[int, EngineConfig] | None = None) -> None:
        self.pools: list[EnginePool] = []
        self.ledgers: list[BillingLedger] = []
        self.port = 0
        for k in range(n):
            ledger = BillingLedger()
            config = (configs or {}).get(k) or EngineConfig(time_scale=5.0)
            ports = [self.port] if self.port else None
            pool = start_engines(1, config, ports, ledger=ledger, host=self.address(k))
            self.port = self.port or int(pool.urls[0].rsplit(":", 1)[1].removesuffix("/v1"))
            self.pools.append(pool)
            self.ledgers.append(ledger)

    @staticmethod
    def address(k: int) -> str:
        return f"127.0.0.{k + 2}"

    def url(self, k: int) -> str:
        return endpoint_url(self.address(k), self.port)

    def executed(self, k: int) -> int:
        return sum(self.ledgers[k].count_by_custom_id().values())

    def executions(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for ledger in self.ledgers:
            total.update(ledger.count_by_custom_id())
        return total

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


@pytest.fixture
def cluster() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(n: int, configs: dict[int, EngineConfig] | None = None) -> Cluster:
        made.append(Cluster(n, configs))
        return made[-1]

    yield make
    for c in made:
        c.close()


class Results:
    """A checkpoint keeping every row; `at(k)` is an event set once k rows were committed."""

    def __init__(self) -> None:
        self.frames: list[pl.DataFrame] = []
        self.lock = threading.Lock()
        self.rows = 0
        self.events: dict[int, threading.Event] = {}

    def at(self, rows: int) -> threading.Event:
        with self.lock:
            event = self.events.setdefault(rows, threading.Event())
            if self.rows >= rows:
                event.set()
            return event

    def __call__(self, frame: pl.DataFrame) -> None:
        with self.lock:
            self.frames.append(frame)
            self.rows += frame.height
            for rows, event in self.events.items():
                if self.rows >= rows:
                    event.set()

    @property
    def frame(self) -> pl.DataFrame:
        return pl.concat(self.frames) if self.frames else pl.DataFrame(schema=RESULT_SCHEMA)


def discover_config(names: Names, **overrides: Any) -> PoolConfig:
    values: dict[str, Any] = {
        **FAST,
        "discover": f"dns:{NAME}:{names.port}",
        "resolver": names,
        "discover_interval_s": 0.02,
        "adaptive": False,  # a fixed cap per engine: the run's pace does not depend on metrics
        "initial_inflight": 4,
        "checkpoint_every": 10,
        **overrides,
    }
    return PoolConfig(**values)


class Beside:
    """Steps run on a thread beside a run: `with beside.running(steps):` around the run. A wait
    of theirs fails the moment the run is over (what it waits for can no longer happen), so a
    test ends with its reason rather than hanging; the test's timeout bounds everything else."""

    def __init__(self) -> None:
        self.over = threading.Event()
        self.errors: list[BaseException] = []

    def _running(self) -> bool:
        return not self.over.is_set()

    def until(self, check: Callable[[], bool], what: str) -> None:
        wait_until(check, what, still_going=self._running, recheck_s=0.01)

    def event(self, event: threading.Event, what: str) -> None:
        wait_for_event(event, what, still_going=self._running)

    def applied(self, names: Names) -> None:
        self.event(names.applied, "the pool looking the name up again")

    @contextlib.contextmanager
    def running(self, steps: Callable[[], None]) -> Iterator[None]:
        def target() -> None:
            try:
                steps()
            except BaseException as exc:  # noqa: BLE001 - re-raised by the test after the run
                self.errors.append(exc)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.over.set()
            thread.join()


def assert_every_row_once(results: Results, requests: pl.DataFrame) -> pl.DataFrame:
    frame = results.frame
    assert sorted(frame["custom_id"].to_list()) == sorted(requests["custom_id"].to_list())
    assert set(frame["status"]) == {"answered"}
    return frame


# -- engines joining and leaving mid-run -----------------------------------------------------------


def test_engines_added_and_removed_mid_run_answer_every_row_once(cluster):
    """Two engines resolved; after 100 results a third is added (it gets requests), and once it
    has executed some, the second is removed: from that moment it is sent nothing new, its
    in-flight requests finish there, and every row is executed exactly once over the three."""
    c = cluster(3)
    names = Names([c.address(0), c.address(1)], c.port)
    requests = make_requests(700)
    results = Results()
    beside = Beside()
    seen: dict[str, int] = {}

    def scale() -> None:
        beside.event(results.at(100), "100 rows committed")
        names.set([c.address(0), c.address(1), c.address(2)])
        beside.applied(names)
        beside.until(lambda: c.executed(2) >= 10, "the new engine executing requests")
        seen["rows_at_removal"] = results.rows
        names.set([c.address(0), c.address(2)])
        beside.applied(names)

    with beside.running(scale):
        stats = run_pool(requests, discover_config(names), results)
    assert not beside.errors, beside.errors
    assert seen["rows_at_removal"] < len(requests), "the run ended before the removal"

    assert_every_row_once(results, requests)
    assert c.executions() == dict.fromkeys(requests["custom_id"], 1)  # no request ran twice
    assert stats.resent == [] and stats.failovers == 0

    added, removed = stats.per_endpoint[c.url(2)], stats.per_endpoint[c.url(1)]
    assert added.answered > 0 and c.executed(2) == added.sent == added.answered
    assert added.drains == 0 and added.drained_after is None
    # removed: no send after the removal, and its engine executed exactly what was sent there
    assert removed.drains == 1
    assert removed.drained_after == removed.sent == c.executed(1) == removed.answered
    assert set(stats.per_endpoint) == {c.url(0), c.url(1), c.url(2)}
    assert stats.answered == len(requests)


def test_a_removed_engine_that_dies_has_its_in_flight_requests_requeued(cluster):
    """The second engine is slow (its requests take a while), so when it leaves the name it
    has requests in flight; it is then killed, as a deleted pod would be. Those requests fail
    with connection errors and go to the first engine: every row is answered exactly once, and
    a request runs on two engines only if the dead one finished it without its answer arriving
    (the pool lists those as re-sent)."""
    slow = EngineConfig(time_scale=1.0, decode_step_s_base=0.2)  # seconds per request
    c = cluster(2, {1: slow})
    names = Names([c.address(0), c.address(1)], c.port)
    requests = make_requests(300)
    results = Results()
    beside = Beside()

    def scale_down() -> None:
        beside.event(results.at(40), "40 rows committed")
        names.set([c.address(0)])
        beside.applied(names)
        c.pools[1].stop(0)  # abrupt: open connections reset, new ones refused

    with beside.running(scale_down):
        stats = run_pool(requests, discover_config(names, max_attempts=50), results)
    assert not beside.errors, beside.errors

    assert_every_row_once(results, requests)
    executions = c.executions()
    assert set(executions) == set(requests["custom_id"])
    assert {cid for cid, n in executions.items() if n > 1} <= set(stats.resent)
    gone = stats.per_endpoint[c.url(1)]
    assert gone.drains == 1 and gone.drained_after == gone.sent
    assert gone.requeued >= 1  # it had requests in flight when it died; none was lost
    assert gone.answered + gone.requeued == gone.sent


def test_a_failed_lookup_keeps_the_endpoints(cluster, caplog):
    """A lookup that fails (DNS down, a timeout) says nothing about the servers: the pool keeps
    both engines rather than draining them, says so in a warning, and finishes on them."""
    c = cluster(2)
    names = Names([c.address(0), c.address(1)], c.port)
    requests = make_requests(300)
    results = Results()
    beside = Beside()

    def break_dns() -> None:
        beside.event(results.at(40), "40 rows committed")
        names.failing = True
        beside.until(lambda: names.failures >= 3, "three failed lookups")
        names.failing = False

    with caplog.at_level(logging.WARNING, logger="lowtide.vllm_pool"), beside.running(break_dns):
        stats = run_pool(requests, discover_config(names), results)
    assert not beside.errors, beside.errors

    assert_every_row_once(results, requests)
    assert c.executions() == dict.fromkeys(requests["custom_id"], 1)
    assert all(e.drains == 0 for e in stats.per_endpoint.values())
    assert all(e.answered > 0 for e in stats.per_endpoint.values())
    warned = [r.getMessage() for r in caplog.records if "cannot resolve" in r.getMessage()]
    assert warned and all("keeping the endpoints" in m for m in warned)


def test_a_pool_that_starts_with_no_address_waits_for_one(cluster):
    """A name with no address yet (the Deployment still starting) is not an error: the run
    waits and starts sending when an engine appears (here with the adaptive cap, so the
    joining engine's /metrics watch runs too)."""
    c = cluster(1)
    names = Names([], c.port)
    requests = make_requests(60)
    results = Results()
    beside = Beside()

    def engine_appears() -> None:
        beside.until(lambda: names.returned >= 0 and names.version == 0, "a first lookup")
        names.set([c.address(0)])

    with beside.running(engine_appears):
        stats = run_pool(requests, discover_config(names, adaptive=True), results)
    assert not beside.errors, beside.errors
    assert_every_row_once(results, requests)
    assert stats.per_endpoint[c.url(0)].answered == len(requests)
    assert c.executions() == dict.fromkeys(requests["custom_id"], 1)


def test_dns_localhost_resolves_through_getaddrinfo_to_a_working_endpoint():
    """No seam: `dns:localhost:PORT` goes through the system resolver."""
    ledger = BillingLedger()
    with start_engines(1, EngineConfig(time_scale=20.0), ledger=ledger) as pool:
        port = int(pool.urls[0].rsplit(":", 1)[1].removesuffix("/v1"))
        assert "127.0.0.1" in resolve_addresses("localhost", port)
        config = PoolConfig.from_spec(PoolSpec(discover=f"dns:localhost:{port}"), **FAST)
        requests = make_requests(40)
        results = Results()
        stats = run_pool(requests, config, results)
    assert_every_row_once(results, requests)
    assert stats.per_endpoint[f"http://127.0.0.1:{port}/v1"].answered == 40
    assert ledger.count_by_custom_id() == dict.fromkeys(requests["custom_id"], 1)


# -- configuration ---------------------------------------------------------------------------------


def test_endpoint_urls_and_address_order():
    assert endpoint_url("10.1.2.3", 8000) == "http://10.1.2.3:8000/v1"
    assert endpoint_url("fd00::1", 8000) == "http://[fd00::1]:8000/v1"
    assert endpoint_url("fe80::1%eth0", 8000) == "http://[fe80::1%25eth0]:8000/v1"
    assert resolve_addresses("127.0.0.10", 80) == ["127.0.0.10"]


def test_environment_urls_win_over_discover_and_discover_needs_no_urls():
    spec = PoolSpec(discover="dns:vllm:8000")
    assert PoolConfig.from_spec(spec).discover == "dns:vllm:8000"
    assert PoolConfig.from_spec(spec).urls == ()
    from_env = PoolConfig.from_spec(spec, env_urls="http://env-a:8000")
    assert (from_env.urls, from_env.discover) == (("http://env-a:8000/v1",), None)
    with pytest.raises(PoolConfigError) as err:
        PoolConfig.from_spec(PoolSpec())
    assert "[pool] discover" in str(err.value) and "LOWTIDE_VLLM_URLS" in str(err.value)
    with pytest.raises(PoolConfigError, match="urls or discover, not both"):
        PoolConfig(urls=("http://a:1",), discover="dns:a:1")
    with pytest.raises(PoolConfigError, match=r"\[pool\] discover 'dns:a'"):
        PoolConfig(discover="dns:a")


JOB = """
name = "t"
[input]
path = "in.csv"
id_column = "id"
text_column = "body"
[output]
schema = {type = "object", properties = {a = {type = "string"}}}
[model]
name = "m"
backend = "vllm"
[pool]
"""


@pytest.mark.parametrize(
    "pool,message",
    [
        ('discover = "vllm:8000"', "'vllm:8000' is not of the form dns:NAME:PORT"),
        ('discover = "dns:vllm"', "'dns:vllm' is not of the form dns:NAME:PORT"),
        ('discover = "http://vllm:8000"', "is not of the form dns:NAME:PORT"),
        ('discover = "dns::8000"', "'dns::8000' has no valid NAME"),
        ('discover = "dns:vllm svc:8000"', "has no valid NAME"),
        ('discover = "dns:[nope]:8000"', "has no valid NAME"),
        ('discover = "dns:vllm:0"', "needs a PORT from 1 to 65535"),
        ('discover = "dns:vllm:8000/v1"', "needs a PORT from 1 to 65535"),
        (
            'discover = "dns:vllm:8000"\nurls = ["http://a:8000/v1"]',
            "[pool] urls and discover are both set; keep one",
        ),
    ],
)
def test_bad_discover_values_name_the_key_on_one_line(tmp_path: Path, pool: str, message: str):
    job = tmp_path / "job.toml"
    job.write_text(JOB + pool + "\n")
    with pytest.raises(JobFileError) as err:
        load_job(job)
    text = str(err.value)
    assert message in text and "\n" not in text
    if "both set" not in message:
        assert "[pool.discover]" in text and "dns:vllm-headless" in text  # the key, an example


@pytest.mark.parametrize(
    "value", ["dns:vllm:8000", "dns:vllm.ns.svc.cluster.local.:8000", "dns:[fd00::1]:80"]
)
def test_good_discover_values_load(tmp_path: Path, value: str):
    job = tmp_path / "job.toml"
    job.write_text(JOB + f'discover = "{value}"\n')
    assert load_job(job).pool.discover == value
