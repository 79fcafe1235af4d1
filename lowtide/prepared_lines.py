"""Each unsent batch's request lines, built in one pass over the store before sending.

Building one batch's lines in the store reads every message of its requests' files; at a
million requests that cost ~1.7 s of CPU per 50,000-line batch, ~35 s for one night's twenty. So the
run's unsent batches get their lines from one pass (`LinesStore.each_batch_lines`), written
to an Arrow IPC file per batch in the run's work directory, and each send reads its own file.
IPC, not parquet: each slice adds a few small pieces to every batch's file, and parquet paid
for each piece (row-group pages, a dictionary tried on unique lines): 4.6 s of a 1M-row night's
CPU under the profiler, where IPC only copies the bytes; reading back is a memory map.

The files are a cache of what the store would build, never a source of truth: a file missing,
unfinished (written under a temporary name, renamed when complete) or of another line count
than the batch's row is ignored, and the store builds the lines as before. Lines come back in
`custom_id` order, as `batch_lines` gives them, so either way the same bytes are sent.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from lowtide.request_lines import RequestLines

if TYPE_CHECKING:
    from lowtide.store import Store

_FOLDER = "lines"


def _path(work_dir: Path, batch_id: str) -> Path:
    return work_dir / _FOLDER / f"{batch_id}.arrow"


def prepare(store: Store, work_dir: Path, batch_ids: list[str]) -> None:
    """Write the lines of `batch_ids`, one file per batch, replacing any an earlier attempt
    left (the files live only between here and each batch's send). Worth it from two batches
    on; a single batch is read from the store directly."""
    if len(batch_ids) < 2:
        return
    for batch_id in batch_ids:
        discard(work_dir, batch_id)
    (work_dir / _FOLDER).mkdir(parents=True, exist_ok=True)
    writers: dict[str, ipc.RecordBatchFileWriter] = {}

    def sink(part: pa.RecordBatch) -> None:
        table = pa.Table.from_batches([part]).select(["custom_id", "line"])
        ids = part.column("batch_id")
        for batch_id in pc.unique(ids).to_pylist():  # a few batches per slice, not rows
            rows = table.filter(pc.equal(ids, batch_id))
            if batch_id not in writers:
                writers[batch_id] = ipc.new_file(
                    _unfinished(_path(work_dir, batch_id)), rows.schema
                )
            writers[batch_id].write_table(rows)

    try:
        store.each_batch_lines(batch_ids, sink)
    finally:
        for writer in writers.values():
            writer.close()
    for batch_id in writers:
        _unfinished(_path(work_dir, batch_id)).rename(_path(work_dir, batch_id))


def _unfinished(path: Path) -> Path:
    return path.with_suffix(".partial")


def read(work_dir: Path, batch_id: str, n_requests: int) -> RequestLines | None:
    """The batch's prepared lines in `custom_id` order, or None when there is no complete file
    of exactly `n_requests` lines (the caller builds them from the store then)."""
    path = _path(work_dir, batch_id)
    try:
        # mapped, not read: the lines are copied once, by the sort below
        table = ipc.open_file(pa.memory_map(str(path))).read_all()
    except (OSError, pa.ArrowInvalid):
        return None
    if table.num_rows != n_requests:
        return None
    ordered = table.take(pc.sort_indices(table, [("custom_id", "ascending")]))
    return RequestLines(ordered.column("line"))


def discard(work_dir: Path, batch_id: str) -> None:
    """The batch was sent: its file only takes space now."""
    with contextlib.suppress(FileNotFoundError):
        _path(work_dir, batch_id).unlink()
