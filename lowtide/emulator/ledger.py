"""What the emulated providers would bill.

Every request a provider actually executed is one entry. Requests that never ran (expired,
cancelled before running, a batch that failed validation) leave no entry; requests that ran but
ended in a provider error are kept apart with `billed=False`, because providers do not charge
for them. Tests use this to prove that a rerun never pays twice.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Execution:
    provider: str  # "openai" | "anthropic" | "vllm"
    kind: str  # "batch" | "realtime"
    batch_id: str | None
    custom_id: str | None
    model: str
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    at: float
    billed: bool = True
    # which server of an emulated vLLM pool ran it ("0", "1", ...); None for the hosted APIs
    server: str | None = None


class BillingLedger:
    """Thread-safe, append-only record of executed requests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[Execution] = []

    def record(
        self,
        *,
        provider: str,
        kind: str,
        model: str,
        input_tokens: int,
        output_tokens: int,
        cached_input_tokens: int = 0,
        batch_id: str | None = None,
        custom_id: str | None = None,
        at: float | None = None,
        billed: bool = True,
        server: str | None = None,
    ) -> Execution:
        entry = Execution(
            provider=provider,
            kind=kind,
            batch_id=batch_id,
            custom_id=custom_id,
            model=model,
            input_tokens=int(input_tokens),
            cached_input_tokens=int(cached_input_tokens),
            output_tokens=int(output_tokens),
            at=time.time() if at is None else float(at),
            billed=billed,
            server=server,
        )
        with self._lock:
            self._entries.append(entry)
        return entry

    def _snapshot(self) -> list[Execution]:
        with self._lock:
            return list(self._entries)

    def executions(self, provider: str | None = None) -> list[dict[str, Any]]:
        """Billed executions, oldest first."""
        return [
            asdict(e)
            for e in self._snapshot()
            if e.billed and (provider is None or e.provider == provider)
        ]

    def errors(self, provider: str | None = None) -> list[dict[str, Any]]:
        """Requests that ran but ended in a provider error (not billed)."""
        return [
            asdict(e)
            for e in self._snapshot()
            if not e.billed and (provider is None or e.provider == provider)
        ]

    def count_by_custom_id(self, provider: str | None = None) -> dict[str, int]:
        """How many billed executions each custom_id had (realtime calls have none)."""
        counts: Counter[str] = Counter()
        for e in self._snapshot():
            if (
                e.billed
                and e.custom_id is not None
                and (provider is None or e.provider == provider)
            ):
                counts[e.custom_id] += 1
        return dict(counts)

    def total_usage(self, provider: str | None = None) -> dict[str, int]:
        """Summed billed usage: requests, input_tokens, cached_input_tokens, output_tokens."""
        totals = {"requests": 0, "input_tokens": 0, "cached_input_tokens": 0, "output_tokens": 0}
        for e in self._snapshot():
            if e.billed and (provider is None or e.provider == provider):
                totals["requests"] += 1
                totals["input_tokens"] += e.input_tokens
                totals["cached_input_tokens"] += e.cached_input_tokens
                totals["output_tokens"] += e.output_tokens
        return totals

    def to_dict(self) -> dict[str, Any]:
        return {
            "executions": self.executions(),
            "errors": self.errors(),
            "count_by_custom_id": self.count_by_custom_id(),
            "total_usage": self.total_usage(),
        }

    def reset(self) -> None:
        with self._lock:
            self._entries.clear()
