"""Where the pool's servers are and how to feed them: the job file's `[pool]` section and the
environment, resolved once into a `PoolConfig`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lowtide.backends.base import Capabilities, TerminalBackendError
from lowtide.jobspec import PoolSpec, parse_discover

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
Resolver = Callable[[str, int], Sequence[str]]
"""(name, port) → the addresses the name resolves to now; raises OSError when it cannot tell."""


class PoolConfigError(TerminalBackendError):
    """The pool cannot be built from the job file and environment; the message says where."""

    def __init__(self, message: str):
        super().__init__(message, backend="vllm", operation="config")


@dataclass(frozen=True)
class PoolConfig:
    """Where the servers are and how to feed them: `urls`, OpenAI base URLs ending in /v1, or
    `discover` (`dns:NAME:PORT`), whose addresses become the endpoints, re-resolved every
    `discover_interval_s` during the run — exactly one of the two."""

    urls: tuple[str, ...] = ()
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
    discover: str | None = None
    discover_interval_s: float = 15.0
    # The seam tests use to change what the name resolves to; None is socket.getaddrinfo
    # (`discovery.resolve_addresses`).
    resolver: Resolver | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.discover is not None:
            if self.urls:
                raise PoolConfigError("PoolConfig takes urls or discover, not both")
            try:
                parse_discover(self.discover)
            except ValueError as exc:
                raise PoolConfigError(f"[pool] discover {exc}") from exc
            if self.discover_interval_s <= 0:
                raise PoolConfigError("PoolConfig discover_interval_s must be above 0")
        elif not self.urls:
            raise PoolConfigError("PoolConfig needs at least one endpoint URL or discover")
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
        """The pool for a job: endpoints from `env_urls` (comma-separated; the caller passes
        `Settings.vllm_urls`, i.e. LOWTIDE_VLLM_URLS), else the job file's `[pool] discover`,
        else its `[pool] urls` (a job file holds at most one of the two); the API key from
        `env_api_key` (`Settings.vllm_api_key`) or else `[pool] api_key` — the environment
        wins, as everywhere in lowtide — plus the job file's feeding settings. `overrides` set
        any other field (tests, benches)."""
        urls: list[str] = []
        discover: str | None = None
        if env_urls and env_urls.strip():
            urls = [u.strip() for u in env_urls.split(",") if u.strip()]
        elif spec.discover:
            discover = spec.discover
        elif spec.urls:
            urls = list(spec.urls)
        if not urls and discover is None:
            raise PoolConfigError(
                "No vLLM endpoints for backend 'vllm': set [pool] urls = "
                '["http://host:8000/v1", ...] or [pool] discover = "dns:NAME:PORT" in the job '
                "file, or LOWTIDE_VLLM_URLS=http://host:8000/v1,http://host2:8000/v1 in the "
                "environment (looked in: LOWTIDE_VLLM_URLS, job file [pool] discover and "
                "[pool] urls)"
            )
        values: dict[str, Any] = {
            "urls": tuple(urls),
            "discover": discover,
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
