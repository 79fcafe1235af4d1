"""Backend `vllm-run-batch`: a run's requests as `vllm run-batch` input shards on a directory,
answered by a runner lowtide does not drive (an Indexed Job, one pod per shard), and read back
from the output files it leaves.

A shard is a `batches` row like any provider batch. Its files are `DIR/input-00003.jsonl` and
`DIR/output-00003.jsonl` (the Job completion index, five digits), its provider batch id is
`runbatch:` + the input file's URL. `DIR` is anything fsspec opens: a local path, `file://`,
`s3://`, `gs://`, ... (the remote filesystems need their fsspec package installed).

Nothing is sent by `submit`: a planned batch is handed over as `runbatch:awaiting-export:<id>`
until `lowtide shards export` cuts the run's unanswered requests into shards and writes them
(`flows/shards.py`). An output file is read line by line: run-batch writes one line per input
line, in input order, so a shard killed midway leaves complete lines and perhaps a cut-off last
one. A line counts when it ends in a newline; a cut-off last line is left for the next try. Any
other line that is not a JSON object with a `custom_id` is `ShardFileError`, naming the file
and the line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
import polars as pl

from lowtide.backends.base import (
    RESULT_SCHEMA,
    BatchRefs,
    BatchState,
    BatchStatus,
    Capabilities,
    ProviderItem,
)
from lowtide.errors import TerminalBackendError, UserError
from lowtide.request_lines import jsonl_payload

NAME = "vllm-run-batch"
PROVIDER_PREFIX = "runbatch:"
AWAITING_EXPORT = PROVIDER_PREFIX + "awaiting-export:"
_INDEX = re.compile(r"(?:^|/)input-(\d{5})\.jsonl$")

CAPABILITIES = Capabilities(
    name=NAME,
    # a planned batch is only a holding place: `lowtide shards export` re-cuts the run's
    # requests by engine-hours, so planning cuts as little as it can
    max_requests=10_000_000,
    max_bytes=1 << 40,
    structured_output="json_schema",
    wire="openai_chat",
    price_provider="vllm",  # priced by GPU time ([pool] gpu_hour_usd), like the pool
)


class ShardFileError(UserError):
    """A shard file lowtide cannot read (a line that is not JSON, a file that cannot be opened);
    the message names the file, the line and what to do."""


def _fs(url: str):  # noqa: ANN202 - fsspec's AbstractFileSystem, imported on use
    import fsspec.core

    return fsspec.core.url_to_fs(url)


def shard_dir(url: str) -> str:
    """The canonical URL of a shard directory (`file:///abs/path` for a local one), so one
    directory has one spelling in the state file whatever form the user typed."""
    fs, path = _fs(url)
    return str(fs.unstrip_protocol(path.rstrip("/") or "/")).rstrip("/")


def input_url(directory: str, index: int) -> str:
    return f"{directory}/input-{index:05d}.jsonl"


def output_url(directory: str, index: int) -> str:
    return f"{directory}/output-{index:05d}.jsonl"


def output_for(input_file: str) -> str:
    """The output file run-batch writes for an input shard (same directory and index)."""
    found = _INDEX.search(input_file)
    if found is None:
        raise ValueError(f"{input_file} is not a shard input file (input-NNNNN.jsonl)")
    return input_file[: found.start()] + found.group(0).replace("input-", "output-")


def provider_id(input_file: str) -> str:
    return PROVIDER_PREFIX + input_file


def existing_shard_files(directory: str) -> list[str]:
    """Names of the shard files (`input-*`, `output-*`) already in `directory`."""
    fs, path = _fs(directory)
    found = fs.glob(f"{path.rstrip('/')}/input-*.jsonl") + fs.glob(
        f"{path.rstrip('/')}/output-*.jsonl"
    )
    return sorted(str(p).rsplit("/", 1)[-1] for p in found)


def write_shard(url: str, lines: Sequence[str]) -> None:
    """Write one input shard (the stored request lines are run-batch input as they are).
    A rewrite after a crash writes the same bytes again."""
    fs, path = _fs(url)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(jsonl_payload(lines))


def count_lines(url: str) -> int | None:
    """Newline-terminated lines of a file, or None when it does not exist."""
    fs, path = _fs(url)
    if not fs.exists(path):
        return None
    count = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
    return count


@dataclass(frozen=True)
class ShardOutput:
    """What one output file holds so far."""

    rows: pl.DataFrame
    """RESULT_SCHEMA rows of its complete lines, file order."""
    lines: int
    """Complete lines read (blank lines included)."""
    cut_off: bool
    """The file ends in a line without its newline (its writer was killed mid-line)."""


def read_output(url: str) -> ShardOutput | None:
    """Every complete line of a run-batch output file as result rows; None when the file does
    not exist (the shard has not run, or died before writing). ShardFileError for a complete
    line that is not a JSON object with a string `custom_id`."""
    from lowtide.backends.vllm_pool.run_batch import run_batch_results

    fs, path = _fs(url)
    if not fs.exists(path):
        return None
    try:
        content = fs.cat_file(path)
    except OSError as e:
        raise ShardFileError(f"{url}: cannot be read ({e})") from e
    *complete, tail = content.split(b"\n")
    for number, raw in enumerate(complete, start=1):
        if raw.strip():
            _check_line(url, number, raw)
    kept = b"\n".join(line for line in complete if line.strip())
    rows = run_batch_results(kept + b"\n") if kept else pl.DataFrame(schema=RESULT_SCHEMA)
    return ShardOutput(rows=rows, lines=len(complete), cut_off=bool(tail.strip()))


def _check_line(url: str, number: int, raw: bytes) -> None:
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        problem = f"is not JSON ({e})"
    else:
        if isinstance(line, dict) and isinstance(line.get("custom_id"), str):
            return
        problem = "is not a run-batch output line (a JSON object with a string custom_id)"
    raise ShardFileError(
        f"{url}: line {number} {problem}; nothing of this shard was imported. Fix or delete "
        "the file (its requests stay pending) and import again"
    )


class RunBatchShards:
    """The `Backend` of shard files. upload/create only hand a planned batch over to the export
    (nothing leaves the machine); poll and results read a shard's output file."""

    capabilities = CAPABILITIES

    def upload(self, batch_id: str, lines: Sequence[str]) -> str | None:
        return None

    def create(self, batch_id: str, input_file_id: str | None, lines: Sequence[str]) -> str:
        return AWAITING_EXPORT + batch_id

    def find(
        self, batch_id: str, n_requests: int, not_before: float, *, exclude: tuple[str, ...] = ()
    ) -> str | None:
        return None  # create sends nothing, so there is nothing to find: it is simply redone

    def poll(self, provider_batch_id: str) -> BatchState:
        """A handed-over batch waits for the export; a shard is completed once its output holds
        a line per input line, else in progress (run-batch writes as it goes; only the user,
        by exporting again, decides that a shard has stopped)."""
        if provider_batch_id.startswith(AWAITING_EXPORT) or not provider_batch_id.startswith(
            PROVIDER_PREFIX
        ):
            return BatchState(
                BatchStatus.VALIDATING,
                "awaiting `lowtide shards export`",
                provider_batch_id=provider_batch_id,
            )
        source = provider_batch_id.removeprefix(PROVIDER_PREFIX)
        target = output_for(source)
        total = count_lines(source)
        done = count_lines(target)
        name = target.rsplit("/", 1)[-1]
        if done is None or total is None:
            return BatchState(
                BatchStatus.IN_PROGRESS,
                f"no {name} yet",
                provider_batch_id=provider_batch_id,
                done=0,
                total=total,
            )
        complete = done >= total
        return BatchState(
            BatchStatus.COMPLETED if complete else BatchStatus.IN_PROGRESS,
            f"{name}: {done} of {total} lines",
            output_file_id=target,
            provider_batch_id=provider_batch_id,
            counts={"total": total, "completed": min(done, total)},
            done=min(done, total),
            total=total,
        )

    def results(self, state: BatchState) -> pl.DataFrame:
        got = read_output(state.output_file_id) if state.output_file_id else None
        return got.rows if got is not None else pl.DataFrame(schema=RESULT_SCHEMA)

    def cancel(self, provider_batch_id: str) -> None:
        raise TerminalBackendError(
            "run-batch shards run outside lowtide and cannot be cancelled from here: delete "
            "the Indexed Job (kubectl delete job ...) and do not export the run again",
            backend=NAME,
            operation="cancel",
        )

    # the shard files are the user's, on the user's storage: lowtide leaves nothing at a
    # provider and deletes nothing there

    def kept_items(self, batch: BatchRefs) -> list[ProviderItem]:
        return []

    def delete_item(self, item: ProviderItem) -> None:
        return None

    def tagged_items(self, batches: Sequence[BatchRefs], since: float) -> list[ProviderItem]:
        return []
