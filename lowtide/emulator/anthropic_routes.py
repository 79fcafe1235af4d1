"""Anthropic Message Batches and Messages (filled in by the next commit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import APIRouter

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

router = APIRouter()


@dataclass
class MessageBatch:
    id: str


def advance_all(state: EmulatorState, now: float) -> None:
    """Move every unfinished message batch to where the clock says it is."""
