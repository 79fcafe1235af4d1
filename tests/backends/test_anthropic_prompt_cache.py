"""The sample job's Anthropic requests, as the backend translates them, through the official SDK
to the emulator: the cached prefix holds the few-shot examples too, and a prefix below the
model's minimum is not cached at all."""

from __future__ import annotations

from typing import Any

import polars as pl

from lowtide.backends.prompt_cache import anthropic_min_tokens
from lowtide.jobspec import JobSpec
from lowtide.tokens import count_tokens
from tests.backends.test_anthropic_batch import (
    backend_for,
    ids_of,
    run_to_end,
    sample_lines,
)
from tests.emulator.conftest import MakeEmulator


def _cached_by_request(emu: Any, job: JobSpec) -> tuple[list[str], dict[str, dict[str, Any]]]:
    lines = sample_lines(job, 12)
    frame = backend_for(emu).results(run_to_end(emu, backend_for(emu), lines))
    return ids_of(lines), {r["custom_id"]: r for r in frame.iter_rows(named=True)}


def test_the_examples_are_in_the_cached_prefix(make_emu: MakeEmulator, job: JobSpec) -> None:
    """A minimum the system prompt alone does not reach (where the breakpoint used to be) but
    the system prompt with its examples does: the first request writes, the others read."""
    above_system = count_tokens(job.prompt.system) + 20
    emu = make_emu(anthropic_cache_min_tokens=above_system)
    order, rows = _cached_by_request(emu, job)
    first, *later = order
    assert rows[first]["cached_tokens"] == 0
    cached = {rows[c]["cached_tokens"] for c in later}
    assert len(cached) == 1 and cached.pop() >= above_system
    billed = emu.ledger.total_usage("anthropic")
    assert billed["cached_input_tokens"] == sum(r["cached_tokens"] for r in rows.values())


def test_below_the_models_minimum_nothing_is_cached(make_emu: MakeEmulator, job: JobSpec) -> None:
    """At Claude Haiku 4.5's documented minimum the sample's prefix is far too short."""
    minimum = anthropic_min_tokens("claude-haiku-4-5")
    assert minimum == 4096 and job.model.name == "claude-haiku-4-5"
    emu = make_emu(anthropic_cache_min_tokens=minimum)
    _, rows = _cached_by_request(emu, job)
    assert pl.Series([r["cached_tokens"] for r in rows.values()]).eq(0).all()
    assert emu.ledger.total_usage("anthropic")["cached_input_tokens"] == 0
