"""Anthropic's explicit prompt cache in the emulator, through the official SDK over real HTTP:
the cached prefix ends at the block that carries `cache_control`, wherever it is (a system block
or a few-shot turn's block); below the minimum nothing is cached; a write, then reads within
the TTL."""

from __future__ import annotations

from typing import Any

import anthropic

from lowtide.tokens import count_tokens
from tests.emulator.conftest import (
    TEXTS,
    MakeEmulator,
    advance,
    anthropic_client,
    message_params,
)

SYSTEM = "You label banking queries carefully and answer with one JSON object. " * 8
EXAMPLES = [
    ("My new card never came, it has been two weeks and I need it for a trip abroad.", "a"),
    ("I think my wallet was stolen on the train this morning, the card was inside it.", "b"),
    ("Which rate do you apply when I pay in euros with my card in a shop abroad?", "c"),
]
EPHEMERAL = {"type": "ephemeral"}
# Between the system prompt alone and the system prompt with its examples (checked below).
MIN_TOKENS = count_tokens(SYSTEM) + 40


def _turns(marked: bool, examples: list[tuple[str, str]] = EXAMPLES) -> list[dict[str, Any]]:
    """The few-shot turns; with `marked`, the last turn's block carries the breakpoint."""
    turns: list[dict[str, Any]] = []
    for user, label in examples:
        turns.append({"role": "user", "content": user})
        turns.append(
            {"role": "assistant", "content": [{"type": "text", "text": f'{{"l":"{label}"}}'}]}
        )
    if marked:
        turns[-1]["content"] = [{**turns[-1]["content"][0], "cache_control": EPHEMERAL}]
    return turns


def _params(text: str, breakpoint: str, **kw: Any) -> dict[str, Any]:
    """A request with the shared prefix and its breakpoint on "system", "examples" or "none"."""
    system: dict[str, Any] = {"type": "text", "text": SYSTEM}
    if breakpoint == "system":
        system["cache_control"] = EPHEMERAL
    messages = [*_turns(breakpoint == "examples", kw.pop("examples", EXAMPLES))]
    messages.append({"role": "user", "content": text})
    return message_params(text, system=[system], messages=messages, **kw)


def _usage(client: anthropic.Anthropic, params: dict[str, Any]) -> Any:
    return client.messages.create(**params).usage


def _batch_usages(client: anthropic.Anthropic, emu: Any, breakpoint: str) -> list[Any]:
    """Usage of a 4-request batch sharing the prefix, in the order the requests ran."""
    requests = [
        {"custom_id": f"req-{i}", "params": _params(TEXTS[i] + f" #{i}", breakpoint)}
        for i in range(4)
    ]
    batch = client.messages.batches.create(requests=requests)
    advance(emu, 100)
    by_id = {r.custom_id: r.result.message.usage for r in client.messages.batches.results(batch.id)}
    return [by_id[f"req-{i}"] for i in range(4)]


def test_prefix_premise() -> None:
    """The test's prefix: the system prompt alone is below MIN_TOKENS, with examples above."""
    examples = sum(count_tokens(u) + count_tokens(a) for u, a in EXAMPLES)
    assert count_tokens(SYSTEM) < MIN_TOKENS < count_tokens(SYSTEM) + examples


def test_a_breakpoint_after_the_examples_writes_once_then_reads(make_emu: MakeEmulator) -> None:
    emu = make_emu(anthropic_cache_min_tokens=MIN_TOKENS)
    client = anthropic_client(emu)
    first, *later = _batch_usages(client, emu, "examples")
    assert first.cache_creation_input_tokens >= MIN_TOKENS
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    for usage in later:
        assert usage.cache_creation_input_tokens == 0
        assert usage.cache_read_input_tokens == first.cache_creation_input_tokens
        # only the request's own message (and its framing) is left uncached
        assert usage.input_tokens < count_tokens(EXAMPLES[0][0])
    billed = emu.ledger.total_usage("anthropic")
    assert billed["cached_input_tokens"] == 3 * first.cache_creation_input_tokens


def test_a_prefix_below_the_minimum_is_not_cached(make_emu: MakeEmulator) -> None:
    """The old placement (system only) is below the minimum here: nothing is written or read,
    and the whole prompt is input."""
    emu = make_emu(anthropic_cache_min_tokens=MIN_TOKENS)
    client = anthropic_client(emu)
    for usage in _batch_usages(client, emu, "system"):
        assert usage.cache_creation_input_tokens == usage.cache_read_input_tokens == 0
        assert usage.input_tokens > MIN_TOKENS
    assert emu.ledger.total_usage("anthropic")["cached_input_tokens"] == 0


def test_the_breakpoint_position_decides_what_is_cached(make_emu: MakeEmulator) -> None:
    """Same prompt, breakpoint on the system block or after the examples: the prompt's total is
    the same, the cached part ends where the breakpoint is."""
    client = anthropic_client(make_emu(anthropic_cache_min_tokens=1))
    text = TEXTS[0]
    plain = _usage(client, _params(text, "none"))
    on_system = _usage(client, _params(text, "system"))
    on_examples = _usage(client, _params(text, "examples"))
    assert plain.cache_creation_input_tokens == plain.cache_read_input_tokens == 0
    for usage in (on_system, on_examples):
        assert usage.input_tokens + usage.cache_creation_input_tokens == plain.input_tokens
    assert on_system.cache_creation_input_tokens < on_examples.cache_creation_input_tokens
    assert on_examples.input_tokens < on_system.input_tokens


def test_reads_within_the_ttl_and_only_of_the_same_prefix(make_emu: MakeEmulator) -> None:
    emu = make_emu(anthropic_cache_min_tokens=1)
    client = anthropic_client(emu)
    written = _usage(client, _params(TEXTS[0], "examples"))
    assert written.cache_creation_input_tokens > 0
    advance(emu, 299)
    assert _usage(client, _params(TEXTS[1], "examples")).cache_read_input_tokens > 0
    advance(emu, 299)  # each read restarts the five minutes
    assert _usage(client, _params(TEXTS[2], "examples")).cache_read_input_tokens > 0
    advance(emu, 301)  # expired: written again
    again = _usage(client, _params(TEXTS[3], "examples"))
    assert (again.cache_creation_input_tokens, again.cache_read_input_tokens) == (
        written.cache_creation_input_tokens,
        0,
    )
    # one changed example is another prefix: a write, not a read
    other = [*EXAMPLES[:2], ("How much is a transfer to Canada?", "c")]
    changed = _usage(client, _params(TEXTS[0], "examples", examples=other))
    assert changed.cache_creation_input_tokens > 0 and changed.cache_read_input_tokens == 0
