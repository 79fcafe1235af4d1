"""The backend registry: the only place that knows backend names.

Each entry says what its engine can do — provider batches or a stream through a pool, a realtime
path or not, its limits and price key, whether its answers are real — and how to build its
clients. The job file validates names against it, and the flows ask it for capabilities instead
of comparing names. SDKs are imported only when a client is built.

Adding a batch provider is one module with a `Backend` class (see `base.py`), one entry below,
its routes in the emulator and its prices in the price table: `docs/backends.md`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from lowtide.backends.base import Backend, Capabilities
from lowtide.errors import TerminalBackendError

Mode = Literal["batch", "stream"]
EMULATOR_ENGINE = "emulator"
"""The answer family, and the recorded engine (`results.engine`), of every answer lowtide's
emulator gave: through its own backend, or through a real backend's client pointed at it (the
answer carries `wire.EMULATOR_FINGERPRINT`)."""
RealtimeProtocol = Literal["openai", "anthropic"]


@dataclass(frozen=True)
class Connection:
    """How to reach an engine, resolved once per run: plain values only."""

    emulator_url: str | None = None
    """Base URL of lowtide's emulator (for the `emulator` backend)."""
    api_key_block: str | None = None
    """The Prefect Secret block holding the provider key when its variable is unset (the job's
    `[model] api_key_block`); the name only, never the key."""
    keep_files: bool = False
    """The job keeps what it uploads (`[provider] keep_files`): no expiry is asked for."""


@dataclass(frozen=True)
class BackendEntry:
    name: str
    mode: Mode
    """`batch`: provider batches (submit, poll, results); `stream`: shards streamed through a
    pool of servers (`tasks/stream.py`), answered as they go."""
    capabilities: Callable[[], Capabilities]
    """Limits (requests and bytes per batch), structured-output mode and price key."""
    realtime: RealtimeProtocol | None
    """The protocol of its realtime path (stragglers, urgent rows, re-asks), or None."""
    emulated: bool
    """Its answers are the emulator's test data, never a real model's."""
    pricing: Literal["tokens", "gpu_hour"]
    """Tokens × the price table, or the pool's GPU time ([pool] gpu_hour_usd)."""
    make_batch: Callable[[Connection], Backend] | None = None
    make_realtime: Callable[[Connection], Any] | None = None
    emulator_env: Callable[[str], dict[str, str]] = field(default=lambda url: {})
    """Environment that points this backend's SDK at the emulator at `url` (tests, dry runs)."""
    family: str | None = None
    """The provider family whose engines give interchangeable answers for one model id (default:
    the name). The cross-run cache shares answers only within `answer_family`."""
    account_limits: Callable[[Connection], dict[str, float]] = field(default=lambda c: {})
    """The account's queue limits as the engine itself states them (`lowtide.quota` names):
    lowtide's emulator says its own; a real provider says them only by refusing."""
    shard_files: bool = False
    """Its batches are shard files that a runner outside lowtide answers (`vllm run-batch` on
    an Indexed Job): `lowtide shards export` writes them, `shards import` and `collect` read
    the outputs back (`flows/shards.py`)."""

    def answer_family(self, model: str) -> str:
        """Whose answers this engine gives when it runs `model`: `emulator` for an emulated
        engine (test data, whatever model it stands in for), else `<family>:<model>`. Request
        keys carry it, so answers are reused only between engines of one family and model, and
        never from the emulator into a real backend's run (tasks/dedupe.py)."""
        return EMULATOR_ENGINE if self.emulated else f"{self.family or self.name}:{model}"

    @property
    def has_realtime(self) -> bool:
        return self.realtime is not None

    def batch_client(self, connection: Connection) -> Backend:
        if self.make_batch is None:
            raise TerminalBackendError(
                f"backend {self.name!r} streams through a pool of servers and has no provider "
                "batches",
                backend=self.name,
            )
        return self.make_batch(connection)

    def realtime_protocol(self) -> RealtimeProtocol:
        if self.realtime is None:
            raise TerminalBackendError(
                f"backend {self.name!r} has no realtime path", backend=self.name
            )
        return self.realtime

    def realtime_client(self, connection: Connection) -> Any:
        """(An SDK client for) the realtime path; TerminalBackendError when it has none."""
        if self.make_realtime is None:
            raise TerminalBackendError(
                f"backend {self.name!r} has no realtime path", backend=self.name
            )
        return self.make_realtime(connection)


# -- the entries ---------------------------------------------------------------------------------


def _openai_caps() -> Capabilities:
    from lowtide.backends import openai_batch

    return openai_batch.CAPABILITIES


def _emulator_caps() -> Capabilities:
    from dataclasses import replace

    return replace(_openai_caps(), name="emulator", price_provider="emulator")


def _anthropic_caps() -> Capabilities:
    from lowtide.backends import anthropic_batch

    return anthropic_batch.CAPABILITIES


def _vllm_caps() -> Capabilities:
    from lowtide.backends import vllm_pool

    return vllm_pool.CAPABILITIES


def _run_batch_caps() -> Capabilities:
    from lowtide.backends import run_batch_shards

    return run_batch_shards.CAPABILITIES


def _run_batch_shards(connection: Connection) -> Backend:
    from lowtide.backends import run_batch_shards

    return run_batch_shards.RunBatchShards()


def _emulator_v1(connection: Connection) -> str:
    if not connection.emulator_url:
        raise TerminalBackendError(
            "backend 'emulator' needs a running emulator: start one with `lowtide emulator` and set "
            "LOWTIDE_EMULATOR_URL, or use `lowtide run`/`lowtide demo`, which start one in-process",
            backend="emulator",
        )
    return connection.emulator_url.rstrip("/") + "/v1"


def _openai_batch(connection: Connection) -> Backend:
    from lowtide.backends import openai_batch

    return openai_batch.from_environment(
        api_key_block=connection.api_key_block, keep_files=connection.keep_files
    )


def _openai_realtime(connection: Connection) -> Any:
    from lowtide.backends import openai_batch

    return openai_batch.realtime_client_from_environment(api_key_block=connection.api_key_block)


def _emulator_limits(connection: Connection) -> dict[str, float]:
    """The emulator's queue limits, from its own settings (`GET /_emulator/config`)."""
    import math

    import httpx2

    from lowtide.quota import BATCHES_PER_HOUR, ENQUEUED_TOKENS

    url = _emulator_v1(connection).removesuffix("/v1") + "/_emulator/config"
    try:
        config = httpx2.get(url, timeout=10).raise_for_status().json()
    except httpx2.HTTPError:
        return {}  # an emulator that cannot say is treated as a provider that does not
    named = {ENQUEUED_TOKENS: "enqueued_token_limit", BATCHES_PER_HOUR: "batch_creates_per_hour"}
    # a limit the emulator leaves unset is known to be absent (infinite), not unknown
    return {
        name: float(config[field]) if isinstance(config.get(field), int | float) else math.inf
        for name, field in named.items()
    }


def _emulator_batch(connection: Connection) -> Backend:
    from lowtide.backends import openai_batch

    return openai_batch.for_base_url(_emulator_v1(connection), keep_files=connection.keep_files)


def _emulator_realtime(connection: Connection) -> Any:
    from lowtide.backends import openai_batch

    return openai_batch.realtime_client_for_base_url(_emulator_v1(connection))


def _anthropic_batch(connection: Connection) -> Backend:
    from lowtide.backends import anthropic_batch

    return anthropic_batch.from_environment(api_key_block=connection.api_key_block)


def _anthropic_realtime(connection: Connection) -> Any:
    from lowtide.backends import anthropic_batch

    return anthropic_batch.realtime_client_from_environment(api_key_block=connection.api_key_block)


REGISTRY: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry(
            name="emulator",
            mode="batch",
            capabilities=_emulator_caps,
            realtime="openai",
            emulated=True,
            pricing="tokens",
            make_batch=_emulator_batch,
            make_realtime=_emulator_realtime,
            account_limits=_emulator_limits,
        ),
        BackendEntry(
            name="openai",
            mode="batch",
            capabilities=_openai_caps,
            realtime="openai",
            emulated=False,
            pricing="tokens",
            make_batch=_openai_batch,
            make_realtime=_openai_realtime,
            emulator_env=lambda url: {
                "OPENAI_BASE_URL": url.rstrip("/") + "/v1",
                "OPENAI_API_KEY": "emulator",
            },
        ),
        BackendEntry(
            name="anthropic",
            mode="batch",
            capabilities=_anthropic_caps,
            realtime="anthropic",
            emulated=False,
            pricing="tokens",
            make_batch=_anthropic_batch,
            make_realtime=_anthropic_realtime,
            emulator_env=lambda url: {
                "ANTHROPIC_BASE_URL": url.rstrip("/"),
                "ANTHROPIC_API_KEY": "emulator",
            },
        ),
        BackendEntry(
            name="vllm",
            mode="stream",
            capabilities=_vllm_caps,
            realtime=None,
            emulated=False,
            pricing="gpu_hour",
        ),
        BackendEntry(
            name="vllm-run-batch",
            mode="batch",
            capabilities=_run_batch_caps,
            realtime=None,
            emulated=False,
            pricing="gpu_hour",
            make_batch=_run_batch_shards,
            family="vllm",  # the same engines as the pool: one model id, one answer family
            shard_files=True,
        ),
    )
}

KNOWN = tuple(REGISTRY)


def backend_entry(name: str) -> BackendEntry:
    """The registry entry for `name`; TerminalBackendError listing the known names."""
    entry = REGISTRY.get(name)
    if entry is None:
        raise TerminalBackendError(f"Unknown backend {name!r}; known: {', '.join(KNOWN)}")
    return entry


def make_backend(
    name: str, *, emulator_url: str | None = None, api_key_block: str | None = None
) -> Backend:
    """The batch client of backend `name` (`emulator_url`: the emulator's base URL;
    `api_key_block`: the Prefect Secret block to read the key from when its variable is unset)."""
    connection = Connection(emulator_url=emulator_url, api_key_block=api_key_block)
    return backend_entry(name).batch_client(connection)
