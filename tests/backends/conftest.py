"""Fixtures the backend tests share: emulators started from the emulator tests' config, and the
sample job on the Anthropic backend."""

from __future__ import annotations

import pytest

from lowtide.jobspec import JobSpec, load_job
from tests.conftest import SAMPLE_JOB
from tests.emulator.conftest import make_emu  # noqa: F401 - a fixture, shared as it is


@pytest.fixture(scope="module")
def job() -> JobSpec:
    """The sample job on the Anthropic backend (a module that needs another defines its own)."""
    return load_job(SAMPLE_JOB, backend="anthropic")
