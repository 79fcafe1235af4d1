"""A request inside the simulated engine (`engine`), from its arrival to its last token."""

from __future__ import annotations

import asyncio

from lowtide.emulator.engine_reports import GenerationResult

WAITING, RUNNING, DONE = 0, 1, 2


class Seq:
    """One request's life in the engine: its prompt, what it holds of the KV cache, how far its
    prefill and output have come, and when it was scheduled and first answered."""

    __slots__ = (
        "prompt_tokens",
        "hashes",
        "target",
        "finish_reason",
        "future",
        "state",
        "generated",
        "prefill_target",
        "prefilled",
        "shared",
        "private_blocks",
        "cached_tokens",
        "arrival",
        "scheduled",
        "first_token",
        "preemptions",
        "prompt_counted",
    )

    def __init__(self, prompt_tokens, hashes, target, finish_reason, future, arrival):
        self.prompt_tokens: int = prompt_tokens
        self.hashes: tuple[int, ...] = hashes
        self.target: int = target
        self.finish_reason: str = finish_reason
        self.future: asyncio.Future[GenerationResult] = future
        self.state = WAITING
        self.generated = 0
        self.prefill_target = prompt_tokens
        self.prefilled = 0
        self.shared: tuple[int, ...] = ()
        self.private_blocks = 0
        self.cached_tokens: int | None = None
        self.arrival: float = arrival
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.preemptions = 0
        self.prompt_counted = False
