"""Prefect task runs are per stage and per shard, never per row: a run over 20 times more rows
in the same number of shards makes exactly the same task runs. Counted on the Prefect server
the runs reported to."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.sorting import FlowRunSort

from flows.enrich import enrich
from lowtide.emulator import Emulator, EmulatorConfig
from tests.integration.conftest import write_job

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


@pytest.fixture
def quiet_emulator() -> Iterator[Emulator]:
    """No injected errors: no retry round, so the two runs take the same path."""
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=5)) as emu:
        yield emu


def _task_runs_of_newest_flow_run() -> Counter[str]:
    with get_client(sync_client=True) as client:
        (newest,) = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[newest.id]))
        )
    # a task run's name is "<stage>-<run or batch id>": count per stage
    return Counter(t.name.split("-", 1)[0] for t in tasks)


def test_task_runs_do_not_grow_with_rows(quiet_emulator: Emulator, tmp_path: Path) -> None:
    counts = []
    for rows in (50, 1000):
        folder = tmp_path / f"rows-{rows}"
        folder.mkdir()
        job = write_job(folder, rows=rows, eval_rows=5)
        summary = enrich(
            job_file=str(job),
            emulator_url=quiet_emulator.base_url,
            state=str(folder / "state.duckdb"),
            db=str(folder / "lowtide.duckdb"),
        )
        assert summary["status"] == "completed" and summary["rows"] == rows
        counts.append(_task_runs_of_newest_flow_run())
    small, large = counts
    assert small["load"] == 1 and small["submit"] >= 1
    assert large == small
