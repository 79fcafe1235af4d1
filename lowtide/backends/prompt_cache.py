"""Providers' prompt caches, as a quote needs them: the shortest prefix each one caches for a
model, how much of a longer prefix it reads back, and what a cache write costs on top.

Anthropic caches explicitly, up to its `cache_control` breakpoint (`anthropic_params`), from a
minimum that depends on the model; a write costs 1.25× the input price (5-minute TTL), a read
the price table's cached-input price. OpenAI caches on its own, from 1,024 tokens, in 128-token
steps, with no write premium. Sources: Anthropic's prompt-caching page ("Cache limitations",
"Pricing") and OpenAI's prompt-caching guide. The minimums change with each model family: a
model not listed below has no known minimum (None), and a quote says so instead of guessing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lowtide.backends import BackendEntry

ANTHROPIC_MIN_TOKENS: dict[str, int] = {
    "claude-fable-5": 512,
    "claude-mythos-5": 512,
    "claude-opus-4-8": 1024,
    "claude-sonnet-5": 1024,
    "claude-sonnet-4-6": 1024,
    "claude-sonnet-4-5": 1024,
    "claude-opus-4-1": 1024,
    "claude-opus-4": 1024,
    "claude-opus-4-0": 1024,
    "claude-sonnet-4": 1024,
    "claude-sonnet-4-0": 1024,
    "claude-3-7-sonnet": 1024,
    "claude-mythos-preview": 2048,
    "claude-opus-4-7": 2048,
    "claude-3-5-haiku": 2048,
    "claude-3-haiku": 2048,
    "claude-opus-4-6": 4096,
    "claude-opus-4-5": 4096,
    "claude-haiku-4-5": 4096,
}
"""Anthropic's minimum cacheable prompt (tokens) per model, on its own API (Bedrock differs)."""
OPENAI_MIN_TOKENS = 1024
OPENAI_STEP_TOKENS = 128
ANTHROPIC_WRITE_PREMIUM = 0.25
_VERSION_SUFFIX = re.compile(r"-(\d{8}|latest)$")


@dataclass(frozen=True)
class PromptCache:
    """One provider's prompt cache for one model."""

    provider: str
    """The provider as a sentence names it: "Anthropic", "OpenAI"."""
    min_tokens: int | None
    """The shortest prefix it caches for the model; None when lowtide does not know it."""
    step_tokens: int
    """The cached length is a multiple of this (OpenAI: 128; Anthropic: the whole prefix)."""
    write_premium: float
    """What writing a token to the cache costs beyond a plain input token, as a share of the
    input price."""

    def cached_tokens(self, prefix_tokens: int) -> int:
        """Tokens of a `prefix_tokens`-token prefix that a later request reads from the cache:
        0 below the minimum (or when the minimum is not known)."""
        if self.min_tokens is None or prefix_tokens < self.min_tokens:
            return 0
        return prefix_tokens // self.step_tokens * self.step_tokens


def anthropic_min_tokens(model: str) -> int | None:
    """Anthropic's minimum cacheable prompt for `model` (an alias such as `claude-haiku-4-5`
    or a dated id such as `claude-haiku-4-5-20251001`); None for a model not listed."""
    return ANTHROPIC_MIN_TOKENS.get(_VERSION_SUFFIX.sub("", model))


def for_backend(entry: BackendEntry, model: str) -> PromptCache | None:
    """The prompt cache that prices `model`'s requests on `entry`: that of the protocol its
    requests are answered under (batch and realtime share one cache and one set of rules; the
    emulator backend follows OpenAI's, as its emulated provider does). None for an engine priced
    by GPU time, where a cached token costs nothing by itself."""
    if entry.pricing != "tokens":
        return None
    if entry.realtime == "anthropic":
        return PromptCache("Anthropic", anthropic_min_tokens(model), 1, ANTHROPIC_WRITE_PREMIUM)
    if entry.realtime == "openai":
        return PromptCache("OpenAI", OPENAI_MIN_TOKENS, OPENAI_STEP_TOKENS, 0.0)
    return None
