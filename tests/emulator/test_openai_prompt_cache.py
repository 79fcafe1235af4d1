"""OpenAI's automatic prompt cache in the emulator, through the official SDK over real HTTP: the
repeated prefix is every message before the request's own (system prompt and few-shot turns),
cached from the minimum on, in 128-token steps."""

from __future__ import annotations

from typing import Any

import openai

from lowtide.tokens import count_tokens
from tests.emulator.conftest import TEXTS, MakeEmulator, chat_body, openai_client

SYSTEM = "You label banking queries carefully and answer with one JSON object. " * 20
TURNS = [
    {"role": "user", "content": "My new card never came, it has been two weeks. " * 4},
    {"role": "assistant", "content": '{"label": "card_arrival"}'},
    {"role": "user", "content": "Which rate do you apply when I pay in euros abroad? " * 4},
    {"role": "assistant", "content": '{"label": "exchange_rate"}'},
]
# Between the system prompt alone and the system prompt with its examples.
MIN_TOKENS = count_tokens(SYSTEM) + 40


def _cached(client: openai.OpenAI, text: str, turns: list[dict[str, Any]]) -> int:
    body = chat_body(text)
    body["messages"] = [{"role": "system", "content": SYSTEM}, *turns, body["messages"][-1]]
    usage = client.chat.completions.create(**body).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0


def test_few_shot_turns_are_part_of_the_cached_prefix(make_emu: MakeEmulator) -> None:
    turns = sum(count_tokens(t["content"]) for t in TURNS)
    assert count_tokens(SYSTEM) < MIN_TOKENS < count_tokens(SYSTEM) + turns
    client = openai_client(make_emu(openai_cache_min_tokens=MIN_TOKENS))
    assert _cached(client, TEXTS[0], TURNS) == 0  # the first request writes
    cached = _cached(client, TEXTS[1], TURNS)
    assert cached >= 128 and cached % 128 == 0
    assert _cached(client, TEXTS[2], TURNS) == cached


def test_a_prefix_below_the_minimum_is_not_cached(make_emu: MakeEmulator) -> None:
    client = openai_client(make_emu(openai_cache_min_tokens=MIN_TOKENS))
    assert [_cached(client, text, []) for text in TEXTS] == [0, 0, 0, 0]
