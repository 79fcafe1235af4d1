"""Provider keys: the one helper that reads them, and the one message when one is missing.

The SDKs read their own base-URL variables (OPENAI_BASE_URL, ANTHROPIC_BASE_URL); lowtide only
checks that a key is there before it builds a client, so a missing key is one clear line before
anything is sent, never an SDK traceback halfway through a run.
"""

from __future__ import annotations

import os

from lowtide.errors import TerminalBackendError


def require_key(backend: str, variable: str) -> str:
    """The key in `variable`, or TerminalBackendError saying where lowtide looked."""
    value = os.environ.get(variable)
    if not value:
        raise TerminalBackendError(
            f"No API key for backend {backend!r}: set {variable} (looked in: environment). "
            "For a dry run without keys use --backend emulator.",
            backend=backend,
            operation="config",
        )
    return value
