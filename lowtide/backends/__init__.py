"""Backends: one module per engine and an explicit name → factory table."""

from __future__ import annotations

from collections.abc import Callable

from lowtide.backends.base import Backend, Capabilities, TerminalBackendError

KNOWN = ("emulator", "openai", "anthropic", "vllm")


def make_backend(name: str, *, emulator_url: str | None = None) -> Backend:
    """Build the backend `name`. `emulator_url` is the emulator's base URL for 'emulator'."""
    from lowtide.backends import openai_batch

    def anthropic() -> Backend:
        from lowtide.backends import anthropic_batch

        return anthropic_batch.from_environment()

    def vllm() -> Backend:
        from lowtide.backends import vllm_pool

        return PoolOnly(vllm_pool.CAPABILITIES)  # type: ignore[return-value]

    factories: dict[str, Callable[[], Backend]] = {
        "openai": openai_batch.from_environment,
        "anthropic": anthropic,
        "vllm": vllm,
        "emulator": lambda: openai_batch.for_base_url(_emulator_v1(emulator_url)),
    }
    if name not in factories:
        raise TerminalBackendError(f"Unknown backend {name!r}; known: {', '.join(KNOWN)}")
    return factories[name]()


def _emulator_v1(url: str | None) -> str:
    if not url:
        raise TerminalBackendError(
            "backend 'emulator' needs a running emulator: start one with `lowtide emulator` and set "
            "LOWTIDE_EMULATOR_URL, or use `lowtide run`/`lowtide demo`, which start one in-process"
        )
    return url.rstrip("/") + "/v1"


class PoolOnly:
    """The `vllm` backend has no provider batches: shards stream through the pool
    (`tasks/stream.py`). Only its capabilities are used; batch calls are a programming error."""

    def __init__(self, capabilities: Capabilities):
        self.capabilities = capabilities

    def __getattr__(self, name: str):  # noqa: ANN204
        raise TerminalBackendError(
            f"backend 'vllm' streams through a pool of servers and has no batch operation {name!r}"
        )
