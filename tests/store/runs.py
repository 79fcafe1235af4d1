"""Runs as the flow leaves them, for tests of the store's later steps."""

from __future__ import annotations

from lowtide.store import Store

RUN = {
    "job": "j",
    "job_fingerprint": "f",
    "job_file": "job.toml",
    "backend": "openai",
    "model": "m",
    "input_fingerprint": "i",
}
"""A run's fields for `Store.open_or_resume_run`."""


def finish(store: Store, run_id: str, succeeded: int = 1, failed: int = 0) -> str:
    """End `run_id` with its requests answered: no QA hold, no eval, nothing paid; its status."""
    return store.finish_run(
        run_id,
        hold_reasons=[],
        succeeded=succeeded,
        failed=failed,
        eval_accuracy=None,
        cost_usd=0.0,
        realtime_cost_usd=0.0,
        naive_cost_usd=0.0,
    )
