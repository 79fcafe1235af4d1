"""Each unsent batch's request lines, built in one pass over the store before sending.

Building one batch's lines in the store reads every message of its requests' files; at a
million requests that cost ~1.7 s of CPU per 50,000-line batch, ~35 s for one night's twenty.
So the run's unsent batches get their lines from one pass (`LinesStore.each_batch_lines`),
written by polars as the JSONL payload itself, a file per batch in the
run's work directory, and each send uploads its file's bytes as they are. A file's name says
how many lines it holds: counting them again at the send read ~1 GB at a million requests.
(Arrow IPC files before: each send then sorted its lines by custom_id, took them in that order
and joined them into a payload, three copies of ~60 MB a batch, 3.5 s of a 1M-row night's CPU
under the profiler.)

The files are a cache of what the store would build, never a source of truth: a file missing,
unfinished (written under a temporary name, renamed when complete) or of another line count
than the batch's row is ignored, and the store builds the lines as before. A file holds the
batch's lines in the order the pass met them, the store's own lines are in `custom_id` order:
the same lines either way, and a provider reads a batch's lines as a set.
"""

from __future__ import annotations

import contextlib
import re
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import polars as pl

from lowtide.request_lines import JsonlFile
from lowtide.uncached_files import open_uncached_writer

if TYPE_CHECKING:
    from lowtide.store import Store

_FOLDER = "lines"


def _path(work_dir: Path, batch_id: str, n_lines: int) -> Path:
    return work_dir / _FOLDER / f"{batch_id}.{n_lines}.jsonl"


def _files(work_dir: Path, batch_id: str) -> list[Path]:
    """Whatever files `batch_id` has in the folder, finished or not."""
    ours = re.compile(rf"{re.escape(batch_id)}\.(\d+\.jsonl|partial)")
    return [p for p in (work_dir / _FOLDER).iterdir() if ours.fullmatch(p.name)]


def prepare(store: Store, work_dir: Path, batch_ids: list[str]) -> None:
    """Write the lines of `batch_ids`, one JSONL file per batch, replacing any an earlier
    attempt left (the files live only between here and each batch's send). Worth it from two
    batches on; a single batch is read from the store directly."""
    if len(batch_ids) < 2:
        return
    for batch_id in batch_ids:
        discard(work_dir, batch_id)
    (work_dir / _FOLDER).mkdir(parents=True, exist_ok=True)
    files: dict[str, BinaryIO] = {}
    counts: dict[str, int] = {}

    def write(batch_id: str, lines: pl.DataFrame) -> None:
        if batch_id not in files:
            files[batch_id] = open_uncached_writer(_unfinished(work_dir, batch_id))
            counts[batch_id] = 0
        # JSON lines hold no raw newline: written unquoted, each ended by a newline, straight
        # from polars' buffers (no copy of the lines: at a million requests each copy is ~1.8
        # GB of fresh pages, and faulting them in was most of this step's CPU)
        lines.write_csv(files[batch_id], include_header=False, quote_style="never")
        counts[batch_id] += lines.height

    def sink(part: pl.DataFrame) -> None:
        ids, lines = part["batch_id"], part.select("line")
        runs = _runs(ids)
        if runs is not None:  # lines come in runs of one batch: each run written as it lies
            for batch_id, start, length in runs:
                write(batch_id, lines.slice(start, length))
            return
        for batch_id in ids.unique(maintain_order=True).to_list():  # a few batches, not rows
            write(batch_id, lines.filter(ids == batch_id))

    try:
        store.each_batch_lines(batch_ids, sink)
    finally:
        for file in files.values():
            file.close()
    for batch_id, n_lines in counts.items():
        _unfinished(work_dir, batch_id).rename(_path(work_dir, batch_id, n_lines))


_MOST_RUNS = 64
"""Past this many runs of one batch in a slice of lines, each batch's lines are gathered by a
filter instead (a copy of them, but no Python step per run)."""


def _runs(ids: pl.Series) -> list[tuple[str, int, int]] | None:
    """(batch_id, start, length) of each run of equal `ids`, in order; None when there are
    more than `_MOST_RUNS`. A night's lines mostly come in their batches' order, so a slice
    holds one or two runs, written without copying a line (filtering them out copied every
    line of a slice that spans two batches)."""
    if ids.len() == 0:
        return []
    ends = (ids.slice(1) != ids.slice(0, ids.len() - 1)).arg_true()
    if ends.len() >= _MOST_RUNS:
        return None
    bounds = [0, *(int(e) + 1 for e in ends), ids.len()]
    return [(ids[a], a, b - a) for a, b in pairwise(bounds)]


def _unfinished(work_dir: Path, batch_id: str) -> Path:
    return work_dir / _FOLDER / f"{batch_id}.partial"


def read(work_dir: Path, batch_id: str, n_requests: int) -> JsonlFile | None:
    """The batch's prepared lines (their file, read when sent), or None when there is no
    complete file of exactly `n_requests` lines (the caller builds them from the store then)."""
    try:
        return JsonlFile(_path(work_dir, batch_id, n_requests), n_requests)
    except (OSError, ValueError):
        return None


def discard(work_dir: Path, batch_id: str) -> None:
    """The batch was sent: its file only takes space now."""
    if (work_dir / _FOLDER).is_dir():
        for path in _files(work_dir, batch_id):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
