"""enrich: one job end to end — load → chunk → dedupe → assemble → submit → poll → join → parse
→ qa → reconcile → finalize → publish. Tasks are per stage, and per shard where work is sharded;
never per row. Every fact lands in the state file; task results are small (paths, ids, counts).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from prefect import flow
from prefect.runtime import flow_run

from lowtide import artifacts, progress
from lowtide.backends import make_backend
from lowtide.jobspec import JobSpec, load_job
from lowtide.pricing import load_price
from lowtide.settings import Settings
from lowtide.store.publish import source_table
from lowtide.store.state import Store
from tasks.assemble import assemble_task
from tasks.chunk import chunk_task
from tasks.dedupe import dedupe_task
from tasks.finalize import finalize_task, publish_task
from tasks.join import join_task
from tasks.load import load_task
from tasks.parse import parse_task
from tasks.poll import poll_task
from tasks.qa import qa_task
from tasks.reconcile import reconcile_task
from tasks.submit import submit_task


def _run_name() -> str:
    params = flow_run.parameters or {}
    stem = Path(str(params.get("job_file", "job"))).stem
    return f"{stem}-{datetime.now(UTC):%Y-%m-%d-%H%M}"


def _now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@contextlib.contextmanager
def emulator_for(backend: str, url: str | None):
    """The emulator's base URL: the given one, LOWTIDE_EMULATOR_URL, or one started in-process."""
    url = url or os.environ.get("LOWTIDE_EMULATOR_URL")
    if backend != "emulator" or url:
        yield url
        return
    from lowtide.emulator.config import EmulatorConfig
    from lowtide.emulator.server import Emulator

    with Emulator(EmulatorConfig(time_scale=600.0)) as emu:
        yield emu.base_url


def _limits(
    job: JobSpec, settings: Settings, backend_name: str, emulator_url: str | None
) -> tuple[int, int]:
    caps = make_backend(backend_name, emulator_url=emulator_url).capabilities
    max_requests = min(caps.max_requests, settings.shard_max_requests or caps.max_requests)
    return max_requests, caps.max_bytes


def _price_provider(backend_name: str) -> str:
    return "emulator" if backend_name == "emulator" else backend_name


@flow(name="enrich", flow_run_name=_run_name, log_prints=False)
def enrich(
    job_file: str,
    backend: str | None = None,
    state: str | None = None,
    db: str | None = None,
    wait: bool = True,
    emulator_url: str | None = None,
) -> dict[str, Any]:
    """Run one job. Resumes the newest unfinished run of the same job content, so a rerun after
    a crash sends nothing already accepted by the provider."""
    settings = Settings().with_overrides(state=state, db=db)
    job = load_job(job_file, backend)
    backend_name = job.model.backend
    store = Store(settings.state, settings.lock_timeout_s)
    state_path = str(settings.state)
    fingerprint = job.prompt_fingerprint()
    price = load_price(
        job.resolve(job.cost.price_table), _price_provider(backend_name), job.model.name
    )

    run_id = store.resumable_run(job.name, fingerprint)
    if run_id is None:
        run_id = f"{job.name}-{datetime.now(UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(2)}"
        store.save_job(
            job.name,
            job.view_name,
            job.input.id_column,
            orjson.dumps(job.output_schema).decode(),
            job.source_path,
        )
        store.create_run(
            run_id=run_id,
            job=job.name,
            job_fingerprint=fingerprint,
            job_file=job.source_path,
            backend=backend_name,
            model=job.model.name,
            status="running",
            started_at=_now(),
        )
    work_dir = str(settings.work_dir / run_id)

    progress_id = artifacts.start_progress(job.name)

    def batches_progress(stage: str, done: int, total: int, note: str) -> None:
        if stage == "batches":
            artifacts.update_progress(progress_id, done, total)

    progress.add_listener(batches_progress)
    with emulator_for(backend_name, emulator_url) as emu_url:
        try:
            summary = _run_stages(
                job,
                settings,
                store,
                state_path,
                run_id,
                work_dir,
                backend_name,
                emu_url,
                price,
                wait,
            )
            if summary["status"] == "completed":
                artifacts.update_progress(progress_id, 1, 1)
                artifacts.publish_run_report(summary)
            return summary
        except Exception as e:
            # After the manifest exists the run stays resumable; before it, nothing was sent.
            submitted = store.run_batches(run_id).height > 0
            store.update_run(
                run_id,
                error=str(e)[:2000],
                **({} if submitted else {"status": "failed", "finished_at": _now()}),
            )
            raise
        finally:
            progress.remove_listener(batches_progress)


def _run_stages(
    job, settings, store, state_path, run_id, work_dir, backend_name, emu_url, price, wait
):
    progress.report("load")
    loaded = load_task(job, work_dir)
    store.save_sources(
        source_table(job.view_name),
        run_id,
        _read(loaded["sources"]).rename({"text": job.input.text_column}),
    )
    progress.report("chunk")
    chunked = chunk_task(job, loaded, work_dir)
    progress.report("dedupe")
    deduped = dedupe_task(job, chunked, work_dir, state_path, run_id)
    max_requests, max_bytes = _limits(job, settings, backend_name, emu_url)
    plan = assemble_task(
        job, deduped, run_id, state_path, backend_name, max_requests, max_bytes, price.per_mtok()
    )
    if plan["estimate_usd"] is not None:
        store.update_run(run_id, estimate_usd=plan["estimate_usd"])
    store.update_run(
        run_id,
        rows=loaded["rows"],
        units=deduped["row_units"],
        unique_requests=deduped["unique_requests"],
        cache_hits=deduped["cache_hits"],
    )
    from lowtide.crashpoints import crash_point

    crash_point("after_manifest")
    for i, batch_id in enumerate(plan["batches"]):
        progress.report("submit", i, len(plan["batches"]))
        submit_task(batch_id, state_path, backend_name, emu_url)
    sent = int(
        store.scalar("SELECT coalesce(sum(n_requests), 0) FROM batches WHERE run_id = ?", [run_id])
    )
    store.update_run(run_id, requests_sent=sent, status="submitted" if sent else "running")
    ended = poll_task(run_id, state_path, backend_name, emu_url, wait, settings.poll_max_interval_s)
    if not ended:
        return _summary(store, run_id, settings)
    open_batches = store.open_batches(run_id)
    for batch_id in open_batches["batch_id"].to_list():
        progress.report("collect", 0, 0, batch_id)
        joined = join_task(batch_id, state_path, backend_name, emu_url, work_dir)
        parse_task(joined, batch_id, job.output_schema, state_path, run_id)
    progress.report("qa")
    qa = qa_task(job, run_id, state_path, loaded.get("eval"))
    cost = reconcile_task(run_id, state_path, price, backend_name, plan["estimate_usd"])
    counts = finalize_task(run_id, state_path)
    store.update_run(
        run_id,
        status="completed",
        finished_at=_now(),
        succeeded=counts["succeeded"],
        failed=counts["failed"],
        eval_accuracy=qa["eval_accuracy"],
        cost_usd=cost["cost_usd"],
        realtime_cost_usd=cost["realtime_cost_usd"]
        + cost.get("dedupe_savings_usd", 0.0)
        + cost.get("cache_savings_usd", 0.0),
    )
    progress.report("publish")
    publish_task(run_id, state_path, str(settings.db), store.job_views())
    return _summary(store, run_id, settings)


def _read(path: str):
    import polars as pl

    return pl.read_parquet(path)


def _summary(store: Store, run_id: str, settings: Settings) -> dict[str, Any]:
    run = store.get_run(run_id) or {}
    tokens = store.query(
        "SELECT coalesce(sum(input_tokens),0) AS input_tokens, coalesce(sum(cached_tokens),0) AS cached_tokens, "
        "coalesce(sum(output_tokens),0) AS output_tokens FROM costs WHERE run_id = ? AND level = 'run'",
        [run_id],
    ).row(0, named=True)
    metrics = dict(
        store.query("SELECT name, value FROM metrics WHERE run_id = ?", [run_id]).iter_rows()
    )
    reasons = store.query(
        "SELECT reason, count(*) AS n FROM failures WHERE run_id = ? AND kind = 'row' GROUP BY 1 ORDER BY 2 DESC",
        [run_id],
    )
    evals = store.query(
        "SELECT field, accuracy FROM eval_scores WHERE run_id = ? ORDER BY field", [run_id]
    )
    return {
        **{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in run.items()},
        **tokens,
        "metrics": metrics,
        "failures_by_reason": dict(reasons.iter_rows()),
        "eval_by_field": dict(evals.iter_rows()),
        "db": str(settings.db),
        "state": str(settings.state),
    }
