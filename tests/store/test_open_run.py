"""Which run a `lowtide run` drives: one decided in a single transaction."""

from __future__ import annotations

from pathlib import Path

from lowtide.store import Store
from tests.store.runs import RUN, finish


def test_a_second_start_resumes_the_first_run_instead_of_opening_another(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    assert store.open_or_resume_run(run_id="r1", **RUN) == "r1"
    assert store.open_or_resume_run(run_id="r2", **RUN) == "r1"
    assert store.list_runs().height == 1
    # another backend, job content or input is another run
    assert store.open_or_resume_run(run_id="r3", **{**RUN, "backend": "anthropic"}) == "r3"
    assert store.open_or_resume_run(run_id="r4", **{**RUN, "input_fingerprint": "x"}) == "r4"


def test_a_completed_run_is_resumed_until_it_is_published(tmp_path: Path) -> None:
    """Killed (or a full disk) between finishing and publishing: the rerun publishes that run
    rather than asking everything again in a new one; once published, a rerun is a new run."""
    store = Store(tmp_path / "state.duckdb")
    store.open_or_resume_run(run_id="r1", **RUN)
    finish(store, "r1")
    assert store.get_run("r1")["status"] == "completed"
    assert store.open_or_resume_run(run_id="r2", **RUN) == "r1"
    store.mark_published("r1")
    assert store.open_or_resume_run(run_id="r2", **RUN) == "r2"
