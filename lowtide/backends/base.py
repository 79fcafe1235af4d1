"""The protocol every batch backend implements, and what it hands back.

Provider strings never leave their backend: each one maps them to `BatchStatus`
(`lowtide.vocabulary`) in one function. Errors are translated once, at the backend boundary,
into transient (retry later) or terminal (`lowtide.errors`); both are re-exported here for the
backends' convenience.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lowtide.errors import BackendError, TerminalBackendError, TransientBackendError
from lowtide.vocabulary import TERMINAL, BatchStatus, ItemRole, RequestStatus

if TYPE_CHECKING:
    import polars as pl

__all__ = [
    "RESULT_SCHEMA",  # noqa: F822 - built on first use by the module __getattr__
    "TERMINAL",
    "Backend",
    "BackendError",
    "BatchRefs",
    "BatchState",
    "BatchStatus",
    "Capabilities",
    "ItemRole",
    "ProviderItem",
    "QuotaRefusal",
    "RequestStatus",
    "TerminalBackendError",
    "TransientBackendError",
]


@dataclass(frozen=True)
class Capabilities:
    name: str
    max_requests: int
    max_bytes: int
    structured_output: str  # "json_schema" (OpenAI response_format), later "output_config", "tool"
    wire: str  # line format the assembler writes: "openai_chat"
    price_provider: str  # provider column in the price table
    queue: str | None = None
    """What the provider's batch queue is limited by (`lowtide.quota`): `enqueued_tokens` (per
    model; a breach fails the batch at validation) or `queued_requests` (all models; a breach is
    a 429 on create); None for engines without a provider queue."""


@dataclass(frozen=True)
class QuotaRefusal:
    """A provider's refusal of a batch for its queue limit, and the limit when it says it."""

    reason: str
    limit_name: str
    limit: float | None = None


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
    result_ref: str | None = None
    """Where this provider keeps the results when they are not files (Anthropic: the batch id
    whose results endpoint streams them); OpenAI uses output_file_id / error_file_id."""
    done: int | None = None
    """Requests finished so far (answered or errored), as the provider counts them."""
    total: int | None = None
    """Requests in the batch, as the provider counts them."""
    refused: QuotaRefusal | None = None
    """Set when the provider refused the batch for its queue limit (it ran nothing): lowtide
    creates it again when there is room, and its requests never fail for it."""

    @property
    def has_results(self) -> bool:
        """True when `Backend.results` has something to download."""
        return bool(self.output_file_id or self.error_file_id or self.result_ref)


@dataclass(frozen=True)
class BatchRefs:
    """What the state file recorded of one lowtide batch at its provider: where to look."""

    batch_id: str
    provider_batch_id: str | None = None
    input_file_id: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None

    def file_ids(self) -> list[tuple[ItemRole, str]]:
        """(role, file id) of each file recorded for the batch."""
        files = (
            (ItemRole.INPUT, self.input_file_id),
            (ItemRole.OUTPUT, self.output_file_id),
            (ItemRole.ERROR, self.error_file_id),
        )
        return [(role, fid) for role, fid in files if fid]


@dataclass(frozen=True)
class ProviderItem:
    """One thing a provider keeps for a lowtide batch until it is deleted or expires: an
    uploaded or result file (OpenAI), or the batch itself, which holds its requests and results
    (Anthropic)."""

    provider_id: str
    role: ItemRole
    batch_id: str
    bytes: int | None = None
    """Its size as the provider reports it; None where the provider reports none (a batch)."""
    busy: bool = False
    """The provider still works with it (a batch that has not ended, or a file of one): it is
    never deleted."""

    @property
    def kind(self) -> str:
        return "batch" if self.role is ItemRole.BATCH else "file"


def _result_schema() -> dict[str, Any]:
    import polars as pl

    return {
        "custom_id": pl.String,
        "status": pl.String,  # RequestStatus
        "raw_text": pl.String,
        "finish_reason": pl.String,
        "error": pl.String,
        "input_tokens": pl.Int64,
        "cached_tokens": pl.Int64,
        "output_tokens": pl.Int64,
        "emulated": pl.Boolean,  # the answer carries the emulator's fingerprint (wire.py)
    }


def __getattr__(name: str) -> Any:
    """`RESULT_SCHEMA`, the columns every backend's results have, built on first use: polars
    costs every CLI command ~0.3 s to import, and most (status, collect, sql) never need it."""
    if name == "RESULT_SCHEMA":
        schema = _result_schema()
        globals()["RESULT_SCHEMA"] = schema
        return schema
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Backend(Protocol):
    """One engine. Submission is split in two steps so the store can record each id at once."""

    capabilities: Capabilities

    def upload(self, batch_id: str, lines: Sequence[str]) -> str | None:
        """Send a shard's request lines as a file; returns the provider's input file id, or None
        for providers that take requests inline with the create call (no upload step)."""
        ...

    def create(self, batch_id: str, input_file_id: str | None, lines: Sequence[str]) -> str:
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

    # What a batch leaves at the provider (`tasks/release.py`, `lowtide leftovers`). A backend
    # that keeps nothing there (shard files, a pool) returns no items.

    def kept_items(self, batch: BatchRefs) -> list[ProviderItem]:
        """What the provider still keeps of this batch, looked up by the ids the state file
        recorded (one gone already is left out), with sizes where the provider reports them."""
        ...

    def delete_item(self, item: ProviderItem) -> None:
        """Delete it at the provider; one that is gone already counts as deleted."""
        ...

    def tagged_items(self, batches: Sequence[BatchRefs], since: float) -> list[ProviderItem]:
        """Everything the provider keeps of these batches, found by lowtide's tags (a batch's
        metadata, an upload's file name) as well as by the recorded ids, so an upload whose id a
        crash kept from the state file is found too. Only what was created at or after `since`
        (unix seconds) is looked at."""
        ...
