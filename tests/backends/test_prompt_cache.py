"""The providers' prompt-cache rules a quote relies on (`lowtide/backends/prompt_cache.py`)."""

from __future__ import annotations

import pytest

from lowtide.backends import REGISTRY
from lowtide.backends.prompt_cache import PromptCache, anthropic_min_tokens, for_backend


@pytest.mark.parametrize(
    ("model", "minimum"),
    [
        ("claude-haiku-4-5", 4096),
        ("claude-haiku-4-5-20251001", 4096),  # a dated id is its alias
        ("claude-sonnet-4-5", 1024),
        ("claude-opus-4-1-20250805", 1024),
        ("claude-opus-4-7", 2048),
        ("claude-3-5-haiku-latest", 2048),
        ("claude-fable-5", 512),
        ("claude-unknown-9", None),  # not guessed
    ],
)
def test_anthropic_minimum_per_model(model: str, minimum: int | None) -> None:
    assert anthropic_min_tokens(model) == minimum


@pytest.mark.parametrize(
    ("cache", "prefix", "cached"),
    [
        (PromptCache("OpenAI", 1024, 128, 0.0), 1023, 0),
        (PromptCache("OpenAI", 1024, 128, 0.0), 1024, 1024),
        (PromptCache("OpenAI", 1024, 128, 0.0), 1300, 1280),  # whole 128-token steps
        (PromptCache("Anthropic", 1024, 1, 0.25), 1300, 1300),  # the whole prefix
        (PromptCache("Anthropic", None, 1, 0.25), 9000, 0),  # unknown minimum: no promise
    ],
)
def test_cached_tokens(cache: PromptCache, prefix: int, cached: int) -> None:
    assert cache.cached_tokens(prefix) == cached


def test_each_backend_has_its_providers_rules() -> None:
    rules = {name: for_backend(entry, "claude-haiku-4-5") for name, entry in REGISTRY.items()}
    assert rules["anthropic"] == PromptCache("Anthropic", 4096, 1, 0.25)
    assert rules["openai"] == rules["emulator"] == PromptCache("OpenAI", 1024, 128, 0.0)
    assert rules["vllm"] is None and rules["vllm-run-batch"] is None  # priced by GPU time
