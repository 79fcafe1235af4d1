"""Shards of `vllm run-batch` on an Indexed Job (backend `vllm-run-batch`): export a run's
unanswered requests as input shards, import whatever output shards exist.

    lowtide run JOB --backend vllm-run-batch --no-wait   plan: units, requests, planned batches
    lowtide shards export RUN --dir DIR                  DIR/input-00000.jsonl ... (write-ahead)
    (the Job runs `vllm run-batch` per index)            DIR/output-00000.jsonl ...
    lowtide shards import RUN                            answers in; finish and publish when done

Export takes every request of the run that needs an answer and is not in a shard still out:
those of planned batches, and those a stopped shard left. Its rows (`ShardStore
.write_shard_manifest`) are committed before the first file is written, and each shard's
`runbatch:` id once its file is whole, so an export cut short is finished by running it again.

Import (also the first step of `collect` for such a run) reads each open shard's output so
far: a line whose request has no answer yet is stored (parse and store exactly as a downloaded
batch), one already stored is skipped and counted, so importing twice adds nothing. A shard
whose every request has its line is completed; one with a partial output or none stays open,
its other requests pending. Only the next export decides that an open shard with output has
stopped (the Job ended): it ends that shard and sends what it left, and nothing answered.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from lowtide.backends.run_batch_shards import (
    AWAITING_EXPORT,
    PROVIDER_PREFIX,
    count_lines,
    existing_shard_files,
    input_url,
    output_url,
    provider_id,
    read_output,
    shard_dir,
    write_shard,
)
from lowtide.backends.vllm_pool.run_batch import (
    DEFAULT_TOKENS_PER_S,
    ENGINE_HOUR_S,
    plan_shards,
    request_work,
)
from lowtide.context import RunContext, run_context
from lowtide.errors import UserError
from lowtide.jobspec import load_job
from lowtide.lease import driving
from lowtide.settings import Settings
from lowtide.store.shards import ShardStore
from lowtide.vocabulary import ANSWERED, RESUMABLE_RUN, RunStatus
from tasks.assemble import BATCH_ROW_SCHEMA, expected_output_tokens
from tasks.parse import parse_results, store_parsed


def _store(ctx: RunContext) -> ShardStore:
    return ShardStore(ctx.state_path, ctx.lock_timeout_s)


def _directory(input_file: str) -> str:
    return input_file.rsplit("/", 1)[0]


def shard_run(settings: Settings, run_id: str) -> dict[str, Any]:
    """The run, if `lowtide shards` applies to it; UserError naming the run otherwise."""
    from lowtide.backends import REGISTRY

    store = ShardStore(settings.state, settings.lock_timeout_s)
    run = store.require_run(run_id)
    entry = REGISTRY.get(run["backend"])
    if entry is None or not entry.shard_files:
        kinds = ", ".join(name for name, e in REGISTRY.items() if e.shard_files)
        raise UserError(
            f"run {run_id} runs on backend {run['backend']!r}; `lowtide shards` handles runs on "
            f"{kinds} (start one with `lowtide run JOB --backend {kinds} --no-wait`)"
        )
    return run


def shard_dirs(settings: Settings, run_id: str) -> list[str]:
    """The directories the run's shards were exported to, in export order."""
    shards = ShardStore(settings.state, settings.lock_timeout_s).shards(run_id)
    return list(dict.fromkeys(_directory(u) for u in shards["input_file_id"].to_list()))


def pending_requests(ctx: RunContext, run_id: str) -> int:
    """Requests of the run's open batches (planned, or in shards still out) with no answer."""
    return _store(ctx).pending_requests(run_id)


def import_shards(ctx: RunContext, run_id: str) -> dict[str, int]:
    """Store the answers in every open shard's output so far, exactly once per request.

    Returns counts: `imported` lines stored, `already_imported` lines skipped (their request
    already has an answer, or this shard's line was stored before), `foreign` lines whose
    custom_id is not in the shard, and shards `completed`, `partial` (output shorter than the
    shard) and `missing` (no output yet)."""
    store = _store(ctx)
    counts = dict.fromkeys(
        ("imported", "already_imported", "foreign", "completed", "partial", "missing"), 0
    )
    out = store.shards(run_id).filter(
        ~pl.col("collected")
        & pl.col("provider_batch_id").str.starts_with(PROVIDER_PREFIX)
        & ~pl.col("provider_batch_id").str.starts_with(AWAITING_EXPORT)
    )
    for shard in out.iter_rows(named=True):
        batch_id = shard["batch_id"]
        got = read_output(shard["output_file_id"])
        if got is None:
            counts["missing"] += 1
            continue
        members = store.batch_members(batch_id)["custom_id"]
        rows = got.rows.unique(subset="custom_id", keep="first", maintain_order=True)
        mine = rows.filter(pl.col("custom_id").is_in(members.implode()))
        known = store.results_for(mine["custom_id"])
        done = known.filter(pl.col("outcome").is_in(ANSWERED) | (pl.col("batch_id") == batch_id))[
            "custom_id"
        ]
        new = mine.filter(~pl.col("custom_id").is_in(done.implode()))
        counts["foreign"] += rows.height - mine.height
        counts["already_imported"] += got.rows.height - rows.height + mine.height - new.height
        if new.height:
            store_parsed(
                store,
                parse_results(new, ctx.job.output_schema),
                batch_id=batch_id,
                run_id=run_id,
                engine=ctx.answer_family,
            )
            counts["imported"] += new.height
        if mine.height == members.len():
            store.complete_batch(batch_id)
            counts["completed"] += 1
        else:
            counts["partial"] += 1
    if counts["imported"]:
        store.fold_reasks()
    return counts


def export_shards(
    ctx: RunContext,
    run_id: str,
    directory: str,
    *,
    max_requests: int | None = None,
    shards: int | None = None,
    resend_missing: bool = False,
) -> dict[str, Any]:
    """Write the run's requests that need an answer as shards in `directory` (see the module
    docstring); returns {directory, shards (input URLs), requests, stopped, resumed}."""
    store = _store(ctx)
    target = shard_dir(directory)
    recorded = store.shards(run_id)
    unwritten = recorded.filter(pl.col("provider_batch_id").is_null())
    if unwritten.height:  # an export cut short: finish it exactly as it was planned
        where = _directory(unwritten["input_file_id"][0])
        if where != target:
            raise UserError(
                f"run {run_id} has an export to {where} that was cut short; finish it first: "
                f"lowtide shards export {run_id} --dir {where}"
            )
        _write(store, unwritten)
        store.mark_submitted(run_id)
        return {
            "directory": target,
            "shards": unwritten["input_file_id"].to_list(),
            "requests": int(unwritten["n_requests"].sum()),
            "stopped": 0,
            "resumed": True,
        }
    dirs = list(dict.fromkeys(_directory(u) for u in recorded["input_file_id"].to_list()))
    if target in dirs:
        raise UserError(
            f"{target} already holds shards of run {run_id} from an earlier export; export the "
            f"requests still pending to a new directory, e.g. {target}/round-{len(dirs) + 1}"
        )
    present = existing_shard_files(target)
    if present:
        raise UserError(
            f"{target} already holds run-batch files ({', '.join(present[:3])}); export to an "
            "empty directory"
        )
    import_shards(ctx, run_id)  # what the shards answered so far is kept, never sent again
    stopped = _stopped_shards(store.shards(run_id), target, resend_missing)
    planned = store.planned_batches(run_id)
    todo = store.unanswered_members(planned["batch_id"].to_list() + list(stopped))
    custom_ids = todo["custom_id"].unique(maintain_order=True).to_list()
    if not custom_ids:
        store.write_shard_manifest(
            run_id,
            retire=planned["batch_id"].to_list(),
            stopped=stopped,
            batches=_SHARD_ROWS.clear(),
            members=_MEMBER_ROWS.clear(),
        )
        return {"directory": target, "shards": [], "requests": 0, "stopped": len(stopped)}
    attempts = planned["attempt"].to_list() + [
        a + 1 for a in recorded.filter(pl.col("batch_id").is_in(list(stopped)))["attempt"]
    ]
    batches, members = _plan(
        ctx,
        run_id,
        custom_ids,
        target,
        len(dirs) + 1,
        max(attempts),
        max_requests=max_requests,
        shards=shards,
    )
    store.write_shard_manifest(
        run_id,
        retire=planned["batch_id"].to_list(),
        stopped=stopped,
        batches=batches,
        members=members,
    )
    _write(store, batches)
    store.mark_submitted(run_id)
    return {
        "directory": target,
        "shards": batches["input_file_id"].to_list(),
        "requests": len(custom_ids),
        "stopped": len(stopped),
        "resumed": False,
    }


_SHARD_ROWS = pl.DataFrame(
    schema={**BATCH_ROW_SCHEMA, "input_file_id": pl.String, "output_file_id": pl.String}
)
_MEMBER_ROWS = pl.DataFrame(schema={"batch_id": pl.String, "custom_id": pl.String})


def _stopped_shards(shards: pl.DataFrame, target: str, resend_missing: bool) -> dict[str, str]:
    """Open shards the export ends (batch_id → what happened): those with an output, which
    ran and stopped short, and with `resend_missing` those that left none."""
    stopped = {}
    for shard in shards.filter(
        ~pl.col("collected") & pl.col("provider_batch_id").is_not_null()
    ).iter_rows(named=True):
        name = shard["output_file_id"].rsplit("/", 1)[-1]
        lines = count_lines(shard["output_file_id"])
        if lines is None and not resend_missing:
            continue
        what = "no output" if lines is None else f"stopped after {lines} of {shard['n_requests']}"
        stopped[shard["batch_id"]] = f"{name}: {what}; what it left was exported to {target}"
    return stopped


def _plan(
    ctx: RunContext,
    run_id: str,
    custom_ids: list[str],
    target: str,
    round_no: int,
    attempt: int,
    *,
    max_requests: int | None,
    shards: int | None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Shard rows and members for these requests: about one engine-hour of work each."""
    lines = ctx.store.request_lines(custom_ids)
    work = request_work(lines["est_input_tokens"].to_list(), expected_output_tokens(ctx.job))
    tokens_per_s = ctx.job.pool.tokens_per_s or DEFAULT_TOKENS_PER_S
    groups = plan_shards(
        work, budget=tokens_per_s * ENGINE_HOUR_S, max_requests=max_requests, shards=shards
    )
    ids = lines["custom_id"].to_list()
    sizes = lines["line"].str.len_bytes().to_list()
    rows, members = [], []
    for index, group in enumerate(groups):
        batch_id = f"{run_id}-rb{round_no}-{index:05d}"
        rows.append(
            {
                "batch_id": batch_id,
                "shard": index,
                "attempt": attempt,
                "backend": ctx.backend,
                "n_requests": len(group),
                "n_bytes": sum(sizes[i] + 1 for i in group),
                "input_file_id": input_url(target, index),
                "output_file_id": output_url(target, index),
            }
        )
        members += [{"batch_id": batch_id, "custom_id": ids[i]} for i in group]
    return pl.DataFrame(rows, schema=_SHARD_ROWS.schema), pl.DataFrame(
        members, schema=_MEMBER_ROWS.schema
    )


def _write(store: ShardStore, shards: pl.DataFrame) -> None:
    """Write each shard's input file, then record it as handed to the runner."""
    for shard in shards.iter_rows(named=True):
        write_shard(shard["input_file_id"], store.batch_lines(shard["batch_id"]))
        store.record_shard_written(shard["batch_id"], provider_id(shard["input_file_id"]))


def export_run(settings: Settings, run_id: str, directory: str, **options: Any) -> dict[str, Any]:
    """`lowtide shards export`: the run's context and lease around `export_shards`."""
    run = shard_run(settings, run_id)
    if RunStatus(run["status"]) not in RESUMABLE_RUN:
        raise UserError(
            f"run {run_id} is {run['status']}; only a running or submitted run has requests to "
            "export"
        )
    job = load_job(run["job_file"], run["backend"])
    with run_context(settings, job) as ctx, driving(ctx.store, run_id):
        return export_shards(ctx, run_id, directory, **options)
