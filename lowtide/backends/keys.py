"""Provider keys: the one helper that reads them, and the one message when one is missing.

A key comes from its environment variable or, when that is unset and the job names one
(`[model] api_key_block`), from a Prefect Secret block, so a deployment's worker needs no key in
its environment. The SDKs read their own base-URL variables (OPENAI_BASE_URL,
ANTHROPIC_BASE_URL); lowtide only checks that a key is there before it builds a client, so a
missing key is one clear line before anything is sent, never an SDK traceback halfway through a
run. The key itself is returned to the client factory and nowhere else: no message, log line or
stored value carries it. A missing key is a `CredentialsError`: the run stays resumable, and the
next run with the key sends what this one could not.
"""

from __future__ import annotations

from lowtide.errors import CredentialsError, scrub
from lowtide.settings import provider_key


def require_key(backend: str, variable: str, block: str | None = None) -> str:
    """The key in `variable`, else the value of the Prefect Secret block named `block` (when
    given); CredentialsError naming both places when neither has one."""
    value = provider_key(variable)
    if value:
        return value
    if not block:
        raise CredentialsError(
            f"No API key for backend {backend!r}: set {variable} (looked in: environment). "
            "For a dry run without keys use --backend emulator; to read the key from a Prefect "
            "Secret block instead, name it in the job file's [model] api_key_block.",
            backend=backend,
            operation="config",
        )
    return secret_from_block(block, backend, variable)


def secret_from_block(block: str, backend: str, variable: str) -> str:
    """The key saved in the Prefect Secret block `block` (read when `variable` is unset);
    CredentialsError saying why not when it holds none."""
    value, why = _from_secret_block(block)
    if value:
        return value
    raise CredentialsError(
        f"No API key for backend {backend!r}: set {variable} or save the key in the Prefect "
        f"Secret block {block!r} (looked in: environment, Prefect Secret block {block!r}: {why}).",
        backend=backend,
        operation="config",
    )


def _from_secret_block(block: str) -> tuple[str | None, str]:
    """(the key, "") from the Secret block, or (None, why not). Prefect errors other than a
    missing block propagate: they are about Prefect, not the key."""
    from prefect.blocks.system import Secret

    from lowtide.prefect_server import start_tied_server

    # blocks live in a Prefect server: with none configured (a CLI run in-process, `lowtide
    # cancel`), read it through a temporary one tied to this process, as Prefect's own would
    # outlive a killed run; a no-op when a server is configured or already started
    start_tied_server()
    try:
        secret: Secret[str] = Secret.load(block, _sync=True)  # type: ignore[assignment,call-arg]
    except ValueError:  # Prefect: "Unable to find block document named …"
        return None, "no such block"
    value = secret.value.get_secret_value()  # as saved: `get()` would parse "123" as JSON
    if not isinstance(value, str):
        return None, "it holds a JSON value, not a key string"
    if not value.strip():
        return None, "it is empty"
    return value.strip(), ""


def refused_key(
    backend: str, variable: str, operation: str, status: int, detail: str, key: str | None
) -> CredentialsError:
    """The provider answered 401/403: the key sent is not one it accepts for this. `detail` is
    the provider's own words, with the key taken out (some echo it back)."""
    return CredentialsError(
        f"{operation}: {backend} refused the API key (HTTP {status}: {scrub(detail, key)}). "
        f"Set a key it accepts in {variable} (or the Prefect Secret block named by [model] "
        "api_key_block) and run the job again: the run resumes and sends what was refused.",
        backend=backend,
        operation=operation,
    )
