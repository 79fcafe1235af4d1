"""One tree of errors, each with the exit code the CLI gives it.

    LowtideError (1)
    ├── UserError (2)      what the user fixes: job file, input, prices, budget, review file,
    │                      pool configuration, a state file written by a newer lowtide
    ├── BusyError (75)     someone else holds the state file, or drives the run
    ├── BackendError (2)   an engine refused or failed:
    │   ├── TransientBackendError (75)   still failing after its retries: retry later
    │   └── TerminalBackendError (2)     retrying the same call cannot help
    │       └── CredentialsError (2)     no key, or the provider refused it (401/403)
    ├── WaitExpiredError (75)   a wait for the provider ran past its deadline
    ├── RunOutcomeError    the run finished, but is not the night's answer
    │   ├── RunHeldError (3)     a gate held it (eval drift, failed share, eval set unanswered)
    │   └── RunFailedError (1)   every row failed: nothing is published
    └── CollectError       a `collect` pass's runs that failed or ended badly, one error each
                           (its exit code: `worst_exit_code` of theirs)

The exit code says what to do next: 0 done and published; 1 the run failed and nothing was
published (look at it); 2 fix the job or its configuration; 3 held by a gate (`lowtide publish
RUN_ID` releases it); 75 (EX_TEMPFAIL) retry later, the run resumes without paying twice. A
scheduler retries only 75 (deployments/k8s/lowtide-run.yaml).

Every message says what was wrong, where, and what to do; attributes carry the context so a flow
can store it. The CLI catches `LowtideError` once and prints one line; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


class LowtideError(Exception):
    """Root of every error lowtide raises on purpose."""

    exit_code = 1


class UserError(LowtideError):
    """Bad input or configuration: nothing was sent, the message says what to change."""

    exit_code = 2


class BusyError(LowtideError):
    """Another lowtide process holds what this one needs; waiting or retrying later helps.

    Exit 75, "retry later", not 2: nothing in the job is wrong. The holder is a `collect` or an
    earlier run still finishing (a CronJob forbids two of its own at once), so a later start
    finds the file free and the run either finished or resumable, paying nothing twice."""

    exit_code = 75


class BackendError(LowtideError, RuntimeError):
    """An engine's error, translated once at the backend boundary; `backend` and `operation`
    say where it happened."""

    exit_code = 2

    def __init__(self, message: str, *, backend: str = "", operation: str = ""):
        self.backend = backend
        self.operation = operation
        super().__init__(message)


class TransientBackendError(BackendError):
    """Rate limits, 5xx, timeouts, dropped connections: worth retrying later. One that escapes
    its task's retries stops the run resumable; the exit code asks the scheduler to retry.
    `retry_after_s` is the provider's own hint (`retry-after`), None when it gave none: a retry
    waits for it."""

    exit_code = 75

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

    def __init__(self, message: str, *, limit: float | None = None, **where: Any):
        self.limit = limit
        super().__init__(message, **where)


class CredentialsError(TerminalBackendError):
    """No key for the provider (environment, Prefect Secret block), or the provider refused the
    one sent (HTTP 401/403). Nothing was answered, so nothing of the run is failed for it: the
    run stays resumable with the error recorded, and the next run with a working key sends it.
    The message never holds the key (`scrub` takes it out of a provider's words)."""


def scrub(text: str, secret: str | None) -> str:
    """`text` with `secret` (a key lowtide holds) taken out, for a message built from what a
    provider said: some echo the key they refused."""
    if not secret:
        return text
    return text.replace(secret, "<key>")


class WaitExpiredError(LowtideError):
    """A wait for the provider (a full queue, a rate limit) ran past its deadline; the run
    stays resumable and is worth starting again later."""

    exit_code = 75


class RunOutcomeError(LowtideError):
    """The run finished, but is not the night's answer. The flow raises it so that its Prefect
    flow run ends Failed (alerts and automations fire); `summary` is the run's summary, which
    the CLI still prints before the reason."""

    def __init__(self, message: str, summary: dict[str, Any]):
        self.summary = summary
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # Prefect stores a failed flow's exception
        return (type(self), (str(self), self.summary))


class RunHeldError(RunOutcomeError):
    """A gate held the run (reasons in `runs.gate_note`): its results are kept, the job view
    still shows the last published run, and `lowtide publish RUN_ID` releases it."""

    exit_code = 3


class RunFailedError(RunOutcomeError):
    """Every row of the run failed: it ends `failed` and is never published."""

    exit_code = 1


class CollectError(LowtideError, ExceptionGroup[Exception]):
    """Some runs could not be collected, or were finished held or failed; the others were.
    Each inner error is one run's; `summaries` are those of every run the pass touched."""

    summaries: list[dict[str, Any]]

    def __new__(
        cls, message: str, errors: list[Exception], summaries: list[dict[str, Any]] | None = None
    ) -> CollectError:
        self = super().__new__(cls, message, errors)
        self.summaries = summaries or []  # None when unpickled: kept in its __dict__ instead
        return self

    def __init__(
        self, message: str, errors: list[Exception], summaries: list[dict[str, Any]] | None = None
    ) -> None:
        super().__init__(message, errors)


def worst_exit_code(codes: list[int]) -> int:
    """One exit code for several errors (a `collect` over many runs): 75 only when every one
    says "retry later", else the first of 1, 2, 3 that occurs (a failure before a job to fix,
    before a held run)."""
    firm = [c for c in codes if c != 75]
    if not firm:
        return 75 if codes else 1
    return min(firm)


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
