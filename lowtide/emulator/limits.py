"""Account-level limits of the emulated providers.

- OpenAI enqueued tokens: a batch's prompt tokens sit in its model's pool from admission
  (validation end) until it reaches a terminal status. The admission itself is decided in
  `openai_batch_lifecycle` on the simulated timeline; `enqueued_tokens` sums the pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState


def enqueued_tokens(state: EmulatorState, model: str | None) -> int:
    """Prompt tokens of `model` held now: admitted OpenAI batches not yet terminal."""
    return sum(
        batch.queue_tokens()
        for batch in state.batches.values()
        if batch.model == model and "in_progress" in batch.times and batch.ended_at() is None
    )
