"""Every batch backend in the registry runs the same small job against the emulator, end to end:
the real SDK over HTTP, real Prefect, a real DuckDB file. A new registry entry is covered the
moment it exists (its `emulator_env` says how to point its SDK at the emulator)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.enrich import enrich
from lowtide.backends import REGISTRY, backend_entry
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.store import Store
from tests.integration.conftest import write_job
from tests.leftovers import assert_nothing_left
from tests.sql import query

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]

# a backend whose batches are shard files run by someone else (vllm-run-batch) has its own
# round trip: tests/integration/test_run_batch_shards.py
BATCH_BACKENDS = sorted(
    name for name, entry in REGISTRY.items() if entry.mode == "batch" and not entry.shard_files
)


def test_every_entry_describes_itself() -> None:
    for name, entry in REGISTRY.items():
        caps = entry.capabilities()
        assert entry.name == name
        assert caps.max_requests > 0 and caps.max_bytes > 0
        assert entry.has_realtime == (entry.make_realtime is not None)
        assert (entry.mode == "batch") == (entry.make_batch is not None)
    assert backend_entry("emulator").emulated and not backend_entry("openai").emulated


@pytest.mark.parametrize("name", BATCH_BACKENDS)
def test_the_same_job_runs_on_every_batch_backend(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=25, eval_rows=5)
    state = tmp_path / f"state-{name}.duckdb"
    monkeypatch.setenv("LOWTIDE_STATE", str(state))
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        for variable, value in backend_entry(name).emulator_env(emu.base_url).items():
            monkeypatch.setenv(variable, value)
        s = enrich(job_file=str(job), backend=name, emulator_url=emu.base_url)
        counts = emu.ledger.count_by_custom_id()
        assert_nothing_left(emu.base_url, state, s["run_id"])
    assert s["status"] == "completed" and s["backend"] == name
    assert s["rows"] == 25 == s["succeeded"] + s["failed"]
    assert s["failed"] == 0
    assert len(counts) == s["unique_requests"] and set(counts.values()) == {1}
    sent = query(
        Store(state),
        "SELECT count(DISTINCT custom_id) AS n FROM batch_requests br "
        "JOIN batches b USING (batch_id) WHERE b.run_id = ? AND b.backend = ?",
        [s["run_id"], name],
    )["n"][0]
    assert sent == s["unique_requests"]  # every request went through this backend's batches
