"""leftovers: what a job's runs left at their provider, listed and, when asked, deleted.

A run deletes what the provider keeps of each batch once its results are stored
(`tasks/release.py`); this finds what is left anyway: a delete that failed, a run killed
between storing and deleting, an upload whose id a crash kept from the state file, everything
a job keeps (`[provider] keep_files`). It looks only at the job's own batches, by the tags
lowtide puts on them (OpenAI: the batch metadata `lowtide_batch_id`, uploads named
`<batch_id>.jsonl`; Anthropic: the batch ids the state file recorded), so other users' and
other jobs' files are never listed or touched.

Each item found is `in_use` (a run in flight still needs it), `kept` (the job keeps its files)
or `left`; `delete` deletes the `left` ones. What was found, deleted or found gone is recorded
in the state file, so `lowtide status` counts what is still there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowtide.backends import backend_entry
from lowtide.backends.base import ProviderItem
from lowtide.context import run_context
from lowtide.jobspec import load_job
from lowtide.settings import Settings
from tasks.release import batch_refs, dispose

IN_USE = "in_use"
KEPT = "kept"
LEFT = "left"

SINCE_SLACK_S = 2 * 86_400
"""How long before a job's first batch the provider's lists are read back to: room for a
provider's clock ahead of ours, and for the state file's clock."""


def sweep(
    settings: Settings,
    job_file: str | Path,
    backend: str | None = None,
    delete: bool = False,
    emulator_url: str | None = None,
) -> dict[str, Any]:
    """What the job's runs on its backend (or `backend`) left at the provider, each item with
    its state; with `delete`, the `left` ones deleted (a failed delete is reported in the
    item's `error`, never raised). Returns {job, backend, items, count, bytes, in_use, kept,
    left, deleted, failed}."""
    job = load_job(job_file, backend)
    found: list[dict[str, Any]] = []
    # a pool keeps nothing at a provider; without a state file no batch of the job is known
    if backend_entry(job.model.backend).mode == "batch" and settings.state.is_file():
        with run_context(settings, job, emulator_url) as ctx:
            batches = ctx.store.job_batch_refs(job.name, ctx.backend)
            if batches.height:
                client = ctx.batch_client()
                refs = [batch_refs(row) for row in batches.iter_rows(named=True)]
                since = float(batches["created_s"].min()) - SINCE_SLACK_S  # type: ignore[arg-type]
                items = client.tagged_items(refs, since)
                live = set(batches.filter("live")["batch_id"].to_list())
                run_of = dict(zip(batches["batch_id"], batches["run_id"], strict=True))
                keep = job.provider.keep_files
                for item in items:
                    state = _state(item, live, keep)
                    done = dispose(client, item, False) if delete and state == LEFT else None
                    found.append(_listed(item, state, run_of[item.batch_id], done))
                _record(ctx.store, found, {i.provider_id for i in items}, list(run_of))
    return _summary(job.name, job.model.backend, found)


def _state(item: ProviderItem, live: set[str], keep: bool) -> str:
    if item.busy or item.batch_id in live:
        return IN_USE
    return KEPT if keep else LEFT


def _listed(
    item: ProviderItem, state: str, run_id: str, done: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "provider_id": item.provider_id,
        "kind": item.kind,
        "role": str(item.role),
        "batch_id": item.batch_id,
        "run_id": run_id,
        "bytes": item.bytes,
        "state": state,
        "deleted": bool(done and done["deleted"]),
        "error": done["error"] if done else None,
    }


def _record(
    store: Any, listed: list[dict[str, Any]], found: set[str], batch_ids: list[str]
) -> None:
    """What the sweep learned, in the state file: the items left or kept (and which it
    deleted), and the recorded ones the provider no longer has (expired, deleted by hand)."""
    rows = [{**item, "kept": item["state"] == KEPT} for item in listed if item["state"] != IN_USE]
    rows += [
        {**row, "gone": True}
        for row in store.recorded_items(batch_ids).iter_rows(named=True)
        if row["provider_id"] not in found
    ]
    if rows:
        store.record_items(rows)


def _summary(job: str, backend: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    def count(state: str) -> int:
        return sum(1 for i in items if i["state"] == state)

    return {
        "job": job,
        "backend": backend,
        "items": items,
        "count": len(items),
        "bytes": sum(i["bytes"] or 0 for i in items),
        "in_use": count(IN_USE),
        "kept": count(KEPT),
        "left": count(LEFT),
        "deleted": sum(1 for i in items if i["deleted"]),
        "failed": sum(1 for i in items if i["error"]),
    }
