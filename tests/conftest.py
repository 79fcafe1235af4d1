"""Shared fixtures: a clean environment per test and one Prefect harness per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE_JOB = REPO / "data" / "jobs" / "support-intents.toml"

# Prefect reads its settings at import; keep it offline, quiet and out of the home folder.
_PREFECT_HOME = REPO / ".lowtide" / "test-prefect"
_PREFECT_HOME.mkdir(parents=True, exist_ok=True)
os.environ.setdefault("PREFECT_HOME", str(_PREFECT_HOME))
os.environ["DO_NOT_TRACK"] = "1"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")

_CLEARED = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No provider keys, no LOWTIDE_* from the outside; the store lives in a temp folder."""
    for name in list(os.environ):
        if name.startswith("LOWTIDE_") or name in _CLEARED:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOWTIDE_STATE", str(tmp_path / "state.duckdb"))
    monkeypatch.setenv("LOWTIDE_DB", str(tmp_path / "lowtide.duckdb"))
    monkeypatch.setenv("LOWTIDE_WORK_DIR", str(tmp_path / "work"))
    return tmp_path


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """A temporary Prefect server for the session (or the one PREFECT_API_URL names)."""
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
