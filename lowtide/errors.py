"""One tree of errors, each with the exit code the CLI gives it.

    LowtideError (1)
    ├── UserError (2)      what the user fixes: job file, input, prices, budget, review file,
    │                      pool configuration, a state file written by a newer lowtide
    ├── BusyError (2)      someone else holds the state file, or drives the run
    └── BackendError (2)   an engine refused or failed: TransientBackendError (retry later),
                           TerminalBackendError (retrying the same call cannot help)

Every message says what was wrong, where, and what to do; attributes carry the context so a flow
can store it. The CLI catches `LowtideError` once and prints one line; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import re
from pathlib import Path


class LowtideError(Exception):
    """Root of every error lowtide raises on purpose."""

    exit_code = 1


class UserError(LowtideError):
    """Bad input or configuration: nothing was sent, the message says what to change."""

    exit_code = 2


class BusyError(LowtideError):
    """Another lowtide process holds what this one needs; waiting or retrying later helps."""

    exit_code = 2


class BackendError(LowtideError, RuntimeError):
    """An engine's error, translated once at the backend boundary; `backend` and `operation`
    say where it happened."""

    exit_code = 2

    def __init__(self, message: str, *, backend: str = "", operation: str = ""):
        self.backend = backend
        self.operation = operation
        super().__init__(message)


class TransientBackendError(BackendError):
    """Rate limits, 5xx, timeouts, dropped connections: worth retrying later. `retry_after_s`
    is the provider's own hint (`retry-after`), None when it gave none: a retry waits for it."""

    def __init__(
        self,
        message: str,
        *,
        backend: str = "",
        operation: str = "",
        retry_after_s: float | None = None,
    ):
        self.retry_after_s = retry_after_s
        super().__init__(message, backend=backend, operation=operation)


class TerminalBackendError(BackendError):
    """Bad request, auth, validation: retrying the same call cannot help."""


class ProviderQueueFullError(TransientBackendError):
    """A batch create refused because the provider's queue, or its create rate, is full (a 429):
    nothing was created or billed, so the same batch is created again once there is room.
    `retry_after_s` is the provider's own hint and `limit` the queue size its message states,
    each None when it gave none."""

    def __init__(
        self,
        message: str,
        *,
        backend: str = "",
        operation: str = "",
        retry_after_s: float | None = None,
        limit: float | None = None,
    ):
        self.limit = limit
        super().__init__(message, backend=backend, operation=operation, retry_after_s=retry_after_s)


class PublishError(LowtideError):
    """The published file could not be written (disk full, a bad path); the previous file is
    left as it was and the run can be published again with `lowtide publish`."""


class InputFileGoneError(TerminalBackendError):
    """A batch create refused because its uploaded input file no longer exists (deleted, past
    retention, or a provider that lost it): nothing was created, so upload again and create."""


# -- user errors ---------------------------------------------------------------------------------


class SettingsError(UserError):
    """A `LOWTIDE_*` variable (or the CLI flag that overrides it) that cannot be used."""


class PrefectServerError(UserError):
    """Prefect's temporary server cannot start (a damaged database, a timeout): the message
    says where its files are and what to do."""


class JobFileError(UserError, ValueError):
    """A job file that cannot be used; the message names the file and what to fix."""

    def __init__(self, path: Path | str, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}")


class InputError(UserError, ValueError):
    """Input that cannot be used; the message names the file, the column or row, and the fix."""


class PriceError(UserError, ValueError):
    """No usable price for a model; the message names the table and what to add."""


class PriceTableError(PriceError):
    """A price table that cannot be read or holds impossible prices: no model can be priced
    from it, so a quote stops rather than skipping the backend."""


class BudgetExceededError(UserError):
    """The pre-run estimate is above the job's budget; nothing was sent."""


class ReviewFileError(UserError, ValueError):
    """A review file that cannot be imported; the message names the file, row and fix."""


class PlanError(UserError, ValueError):
    """The inputs cannot give a capacity plan; says what to change."""


class PoolConfigError(TerminalBackendError, UserError):
    """The vLLM pool cannot be built from the job file and environment; the message says where."""

    def __init__(self, message: str):
        super().__init__(message, backend="vllm", operation="config")


class StateTooNewError(UserError):
    """The state file was written by a newer lowtide."""


class StateMemoryError(LowtideError):
    """DuckDB needed more memory for the state file than it may use (LOWTIDE_STATE_MEMORY_MB).
    What ran out was rolled back; what earlier steps committed stays, so a rerun resumes."""

    def __init__(self, path: Path | str, limit: str, detail: str):
        self.path = str(path)
        self.limit = limit
        first = detail.strip().splitlines()[0] if detail.strip() else "out of memory"
        super().__init__(
            f"state file {path}: DuckDB ran out of the memory it may use for it ({limit}): "
            f"{first}; what ran out was rolled back. Set LOWTIDE_STATE_MEMORY_MB to more MiB "
            "(0: DuckDB's default, 80% of RAM) and run the command again"
        )


class RunNotFoundError(UserError, LookupError):
    """A command named a run (or job) the state file does not have."""


class RunStateError(UserError):
    """The run is in a state where the command does not apply (e.g. publishing a running run)."""


# -- busy ----------------------------------------------------------------------------------------


class StateLockedError(BusyError):
    """Another process holds the state file for longer than we are willing to wait."""

    def __init__(self, path: Path | str, waited_s: float, detail: str):
        self.path = str(path)
        holder = re.search(r"held in (.*?)(?:\. See|$)", detail)
        who = holder.group(1) if holder else "another process"
        super().__init__(
            f"state file {path} is locked by {who}; waited {waited_s:.0f} s. "
            "Wait for that lowtide process to finish (or stop it), or point LOWTIDE_STATE elsewhere."
        )


class RunBusyError(BusyError):
    """Another live process is driving this run; it will finish it. `run_id` and `holder`
    (host:pid:token) say which and who."""

    def __init__(self, message: str, *, run_id: str = "", holder: str = ""):
        self.run_id = run_id
        self.holder = holder
        super().__init__(message)
