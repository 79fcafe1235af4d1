"""The backend protocol, lowtide's status vocabulary, and the errors every backend raises.

Provider strings never leave their backend: each one maps them to `BatchStatus` in one function.
Errors are translated once, at the backend boundary, into transient (retry later) or terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import polars as pl


class BatchStatus(StrEnum):
    PENDING = "pending"  # manifest written, nothing sent yet
    UPLOADED = "uploaded"  # input file accepted, batch not created yet
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)


class RequestStatus(StrEnum):
    """What the provider said about one request, before lowtide parses the answer."""

    ANSWERED = "answered"
    PROVIDER_ERROR = "provider_error"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class BackendError(RuntimeError):
    """Base of backend errors; `backend` and `operation` say where it happened."""

    def __init__(self, message: str, *, backend: str = "", operation: str = ""):
        self.backend = backend
        self.operation = operation
        super().__init__(message)


class TransientBackendError(BackendError):
    """Rate limits, 5xx, timeouts, dropped connections: worth retrying later."""


class TerminalBackendError(BackendError):
    """Bad request, auth, validation: retrying the same call cannot help."""


@dataclass(frozen=True)
class Capabilities:
    name: str
    max_requests: int
    max_bytes: int
    structured_output: str  # "json_schema" (OpenAI response_format), later "output_config", "tool"
    wire: str  # line format the assembler writes: "openai_chat"
    price_provider: str  # provider column in the price table


@dataclass
class BatchState:
    status: BatchStatus
    provider_status: str
    counts: dict[str, int] = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] | None = None
    provider_batch_id: str | None = None


RESULT_SCHEMA = {
    "custom_id": pl.String,
    "status": pl.String,  # RequestStatus
    "raw_text": pl.String,
    "finish_reason": pl.String,
    "error": pl.String,
    "input_tokens": pl.Int64,
    "cached_tokens": pl.Int64,
    "output_tokens": pl.Int64,
}


class Backend(Protocol):
    """One engine. Submission is split in two steps so the store can record each id at once."""

    capabilities: Capabilities

    def upload(self, batch_id: str, lines: list[str]) -> str | None:
        """Send a shard's request lines as a file; returns the provider's input file id, or None
        for providers that take requests inline with the create call (no upload step)."""
        ...

    def create(self, batch_id: str, input_file_id: str | None, lines: list[str]) -> str:
        """Start the batch, tagged with lowtide's batch_id where the provider allows; returns the
        provider batch id. `lines` are lowtide's stored request lines (OpenAI chat format);
        backends with another wire format translate them here."""
        ...

    def find(
        self, batch_id: str, n_requests: int, not_before: float, *, exclude: tuple[str, ...] = ()
    ) -> str | None:
        """The provider batch already created for this lowtide batch, if any (crash repair):
        by metadata tag where the provider keeps one, else by size and creation time, skipping
        provider ids already claimed by other batches (`exclude`)."""
        ...

    def poll(self, provider_batch_id: str) -> BatchState: ...

    def results(self, state: BatchState) -> pl.DataFrame:
        """Every per-request result the provider returned, as a frame with RESULT_SCHEMA."""
        ...

    def cancel(self, provider_batch_id: str) -> None: ...
