"""lowtide's one vocabulary: the states a run and a batch go through, and how a request ends.

Every status string stored in the state file comes from an enum here, so a typo is an import
error rather than a run stuck in a state nothing reads. Provider words never get this far: each
backend maps its own strings to `BatchStatus` (its `map_status`).
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """Where a run is. Transitions are store methods (`lowtide.store.runs`), one per arrow:

    running → submitted (its batches were accepted) → completed | held | cancelled
    running | submitted → cancelling (a user cancelled) → cancelled
    running → failed (refused before anything was sent: budget, bad input)
    running | submitted → failed (every row failed: never published)
    held → completed (published by hand)
    """

    RUNNING = "running"
    SUBMITTED = "submitted"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    HELD = "held"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def in_flight(self) -> bool:
        return self in IN_FLIGHT_RUN

    @property
    def finished(self) -> bool:
        return self in FINISHED_RUN


IN_FLIGHT_RUN = frozenset({RunStatus.RUNNING, RunStatus.SUBMITTED, RunStatus.CANCELLING})
RESUMABLE_RUN = frozenset({RunStatus.RUNNING, RunStatus.SUBMITTED})
FINISHED_RUN = frozenset({RunStatus.COMPLETED, RunStatus.HELD, RunStatus.CANCELLED})


class BatchStatus(StrEnum):
    PENDING = "pending"  # manifest written, nothing sent yet
    UPLOADED = "uploaded"  # input file accepted (or create may have been sent), no batch id yet
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
UNSENT = frozenset({BatchStatus.PENDING, BatchStatus.UPLOADED})


class Channel(StrEnum):
    """How a batch row's requests travel: a provider batch, plain realtime calls, or a pool."""

    BATCH = "batch"
    REALTIME = "realtime"
    POOL = "pool"


REALTIME_BACKEND = "realtime"
"""The `batches.backend` value of a realtime batch (the run's own backend answers it)."""


class RequestStatus(StrEnum):
    """What the provider said about one request, before lowtide parses the answer."""

    ANSWERED = "answered"
    PROVIDER_ERROR = "provider_error"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    MISSING = "missing"


class Outcome(StrEnum):
    """How a request ended, as stored in `results.outcome`."""

    OK = "ok"
    REPAIRED = "repaired"
    REASKED = "reasked"
    PARSE_FAILED = "parse_failed"
    PROVIDER_ERROR = "provider_error"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    MISSING = "missing"


ANSWERED = (Outcome.OK.value, Outcome.REPAIRED.value, Outcome.REASKED.value)
"""Outcomes that carry a validated answer (plain strings, for polars and SQL)."""


def sql_list(values: frozenset[StrEnum] | tuple[str, ...]) -> list[str]:
    """Plain strings of a status set, sorted, for a query parameter."""
    return sorted(str(v) for v in values)


class ItemRole(StrEnum):
    """What a thing lowtide left at a provider is to its batch (`provider_items.role`)."""

    INPUT = "input"  # the uploaded request file (OpenAI)
    OUTPUT = "output"  # the answers file the provider wrote
    ERROR = "error"  # the failed requests' file the provider wrote
    BATCH = "batch"  # the batch itself, holding its requests and results (Anthropic)
