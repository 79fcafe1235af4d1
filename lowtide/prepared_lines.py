"""Each unsent batch's request lines, built in one pass over the store as the batches are sent.

Building one batch's lines in the store reads every message of its requests' files; at a
million requests that cost ~1.7 s of CPU per 50,000-line batch, ~35 s for one night's twenty.
So the run's unsent batches get their lines from one pass (`LinesStore.batch_line_parts`),
written by polars as the JSONL payload itself, and each send uploads those bytes as they are.
A file's name says how many lines it holds: counting them again at the send read ~1 GB at a
million requests.

The pass goes on only as far as the batch being sent needs (`streamed`): a night's lines come
in their batches' order, so each batch's payload is built in memory just before its send and
let go after it. Writing every batch to a file first and reading it back to send cost ~3 s of
kernel CPU at a million requests (1.6 GB through the page cache). Lines of batches not asked
for yet are held up to `_HELD_MOST` bytes; past that, and for a batch complete before its turn,
they go to a file per batch in the run's work directory, read when that batch is sent.

The payloads and files are a cache of what the store would build, never a source of truth: a
payload or file missing, unfinished (a file is written under a temporary name, renamed when
complete) or of another line count than the batch's row is ignored, and the store builds the
lines as before. They hold a batch's lines in the order the pass met them, the store's own
lines are in `custom_id` order: the same lines either way, and a provider reads a batch's lines
as a set.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import threading
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import polars as pl

from lowtide.request_lines import JsonlFile, JsonlLines

if TYPE_CHECKING:
    from lowtide.store import Store

log = logging.getLogger(__name__)

_FOLDER = "lines"

_HELD_MOST = 256 << 20
"""Bytes of lines a pass holds in memory for batches not sent yet (at a million requests a
batch is ~80 MB): in their order, the batch being sent and the start of the next."""


_BUILT_AHEAD = 2
"""Payloads built with the one a send asks for, for the next sends. An upload waits seconds
for the provider, and polars' allocator hands back the pages it keeps once it has idled 3 s:
building each payload alone, between two uploads, faulted its working pages in afresh every
time (standalone over a 1M night's state, with 3.5 s uploads: 0.65 -> 1.35 million page
faults). Three at a time, a third as often; the payloads wait in memory files, not in the
process's own memory."""


def _path(work_dir: Path, batch_id: str, n_lines: int) -> Path:
    return work_dir / _FOLDER / f"{batch_id}.{n_lines}.jsonl"


def _files(work_dir: Path, batch_id: str) -> list[Path]:
    """Whatever files `batch_id` has in the folder, finished or not."""
    ours = re.compile(rf"{re.escape(batch_id)}\.(\d+\.jsonl|partial)")
    return [p for p in (work_dir / _FOLDER).iterdir() if ours.fullmatch(p.name)]


def _unfinished(work_dir: Path, batch_id: str) -> Path:
    return work_dir / _FOLDER / f"{batch_id}.partial"


def _write(file: BinaryIO, lines: pl.DataFrame) -> None:
    # JSON lines hold no raw newline: written unquoted, each ended by a newline, straight from
    # polars' buffers (no copy of the lines: at a million requests each copy is ~1.8 GB of
    # fresh pages, and faulting them in was most of this step's CPU)
    lines.write_csv(file, include_header=False, quote_style="never")


class _Pass:
    """One pass over the lines of a run's unsent batches (`counts`: each one's lines), read on
    only as far as a send needs."""

    def __init__(
        self, store: Store, work_dir: Path, counts: dict[str, int], hold_most: int
    ) -> None:
        self.work_dir, self.counts, self.hold_most = work_dir, counts, hold_most
        self._parts = store.batch_line_parts(list(counts))
        self._met = dict.fromkeys(counts, 0)
        self._held: dict[str, list[pl.DataFrame]] = {}
        self._held_bytes = 0
        self._files: dict[str, BinaryIO] = {}  # batches written to a file as they come
        self._lost: set[str] = set()  # their file could not be written: left to the store
        # each built payload until its batch is sent (with the memory file holding it)
        self._payloads: dict[str, tuple[BinaryIO | None, JsonlLines]] = {}
        self._lock = threading.Lock()
        self.ended = False

    def lines(self, batch_id: str) -> JsonlLines | None:
        """The batch's lines as one payload in memory, the pass read on until it has met them
        all; None when it holds none (not among its batches, written to their file, or not
        all met). The payloads of the next `_BUILT_AHEAD` batches are built with it."""
        with self._lock:
            if batch_id not in self._payloads:
                self._build(batch_id)
                later = list(self.counts)
                at = later.index(batch_id) if batch_id in self.counts else len(later)
                for ahead in later[at + 1 : at + 1 + _BUILT_AHEAD]:
                    if self._held_bytes > self.hold_most:
                        break
                    self._build(ahead)
            held = self._payloads.get(batch_id)
            return held[1] if held is not None else None

    def _build(self, batch_id: str) -> None:
        """Read on until every line of the batch is met, and make them its payload (unless
        they went to its file)."""
        while (
            batch_id in self.counts
            and batch_id not in self._lost
            and not self.ended
            and self._met[batch_id] < self.counts[batch_id]
        ):
            self._read_on(asked=batch_id)
        if batch_id in self._held and self._met[batch_id] == self.counts[batch_id]:
            self._payloads[batch_id] = _payload(self._let_go(batch_id), self.counts[batch_id])

    def drain(self) -> None:
        """Read to the end, every batch to its file."""
        with self._lock:
            while not self.ended:
                self._read_on(asked=None)

    def forget(self, batch_id: str) -> None:
        with self._lock:
            self._let_go(batch_id)
            file, _ = self._payloads.pop(batch_id, (None, None))
            if file is not None:
                file.close()

    def close(self) -> None:
        """Let go of everything held; a file left unfinished is removed."""
        with self._lock:
            self._parts.close()
            self.ended = True
            self._held.clear()
            self._held_bytes = 0
            for file, _ in self._payloads.values():
                if file is not None:
                    file.close()
            self._payloads.clear()
            for batch_id, file in self._files.items():
                file.close()
                _unfinished(self.work_dir, batch_id).unlink(missing_ok=True)
            self._files.clear()

    def _read_on(self, asked: str | None) -> None:
        part = next(self._parts, None)
        if part is None:
            self.ended = True
            return
        ids, lines = part["batch_id"], part.select("line")
        runs = _runs(ids)
        if runs is not None:  # lines come in runs of one batch: each run taken as it lies
            pieces = [(batch_id, lines.slice(start, length)) for batch_id, start, length in runs]
        else:  # a few batches, not rows
            pieces = [(b, lines.filter(ids == b)) for b in ids.unique(maintain_order=True)]
        for batch_id, piece in pieces:
            if batch_id not in self.counts or batch_id in self._lost:
                continue
            self._met[batch_id] += piece.height
            if batch_id in self._files:
                self._to_file(batch_id, [piece])
            else:
                self._held.setdefault(batch_id, []).append(piece)
                self._held_bytes += _size(piece)
        if self._held_bytes > self.hold_most:
            # the batch being sent stays; the others wait in their files
            for batch_id in [b for b in self._held if b != asked]:
                self._to_file(batch_id, self._let_go(batch_id))

    def _let_go(self, batch_id: str) -> list[pl.DataFrame]:
        pieces = self._held.pop(batch_id, [])
        self._held_bytes -= sum(_size(p) for p in pieces)
        return pieces

    def _to_file(self, batch_id: str, pieces: list[pl.DataFrame]) -> None:
        """Append `pieces` to the batch's file; once all its lines are in, the file is
        finished (renamed to say how many)."""
        try:
            if batch_id not in self._files:
                (self.work_dir / _FOLDER).mkdir(parents=True, exist_ok=True)
                self._files[batch_id] = _unfinished(self.work_dir, batch_id).open("wb")
            for piece in pieces:
                _write(self._files[batch_id], piece)
            if self._met[batch_id] == self.counts[batch_id]:
                self._files.pop(batch_id).close()
                _unfinished(self.work_dir, batch_id).rename(
                    _path(self.work_dir, batch_id, self.counts[batch_id])
                )
        except OSError as e:  # a full disk, say: this batch's lines are built by the store
            log.info("%s: request lines not kept in %s: %s", batch_id, self.work_dir, e)
            self._lost.add(batch_id)
            if batch_id in self._files:
                self._files.pop(batch_id).close()
            _unfinished(self.work_dir, batch_id).unlink(missing_ok=True)


_OPEN_AGAIN = Path("/proc/self/fd")
"""Where Linux lets a process open one of its files again, at its start (an upload reads the
payload through a file of its own)."""


def _payload(pieces: list[pl.DataFrame], count: int) -> tuple[BinaryIO | None, JsonlLines]:
    """The lines of `pieces` as one payload: in a file in memory where the system has them
    (Linux), written there by polars straight from its buffers and streamed by the upload a
    piece at a time. Held as bytes, a 1M-row night's payloads were copied twice more, into
    the bytes and by the HTTP library joining the body: ~1.4 million page faults."""
    if hasattr(os, "memfd_create") and _OPEN_AGAIN.is_dir():
        file = open(os.memfd_create("lowtide-lines", os.MFD_CLOEXEC), "wb")  # noqa: SIM115
        try:
            for piece in pieces:
                _write(file, piece)
            file.flush()
            return file, JsonlFile(_OPEN_AGAIN / str(file.fileno()), count)
        except BaseException:
            file.close()
            raise
    payload = io.BytesIO()
    for piece in pieces:
        _write(payload, piece)
    return None, JsonlLines(payload.getvalue(), count)


def _size(lines: pl.DataFrame) -> int:
    return int(lines["line"].str.len_bytes().sum() or 0)


_PASSES: dict[Path, _Pass] = {}
"""The pass open for each run's work directory (`streamed`), found by `read`."""


@contextlib.contextmanager
def streamed(store: Store, work_dir: Path, batch_ids: list[str]) -> Iterator[None]:
    """While open, `read` builds the lines of `batch_ids` in one pass as their sends ask for
    them, in the order the pass meets them (each payload held until its send). Worth it from
    two batches on; a single batch is read from the store directly. Files an earlier attempt
    left for these batches are replaced."""
    if len(batch_ids) < 2:
        yield
        return
    for batch_id in batch_ids:
        discard(work_dir, batch_id)
    counts = {b: int(store.batch(b)["n_requests"]) for b in batch_ids}
    key = work_dir.resolve()
    _PASSES[key] = opened = _Pass(store, work_dir, counts, _HELD_MOST)
    try:
        yield
    finally:
        opened.close()
        if _PASSES.get(key) is opened:
            del _PASSES[key]


def prepare(store: Store, work_dir: Path, batch_ids: list[str]) -> None:
    """Write the lines of `batch_ids`, one JSONL file per batch, in one pass (replacing any an
    earlier attempt left). Worth it from two batches on; a single batch is read from the store
    directly."""
    if len(batch_ids) < 2:
        return
    for batch_id in batch_ids:
        discard(work_dir, batch_id)
    counts = {b: int(store.batch(b)["n_requests"]) for b in batch_ids}
    every = _Pass(store, work_dir, counts, hold_most=0)
    try:
        every.drain()
    finally:
        every.close()


_MOST_RUNS = 64
"""Past this many runs of one batch in a slice of lines, each batch's lines are gathered by a
filter instead (a copy of them, but no Python step per run)."""


def _runs(ids: pl.Series) -> list[tuple[str, int, int]] | None:
    """(batch_id, start, length) of each run of equal `ids`, in order; None when there are
    more than `_MOST_RUNS`. A night's lines mostly come in their batches' order, so a slice
    holds one or two runs, taken without copying a line (filtering them out copied every
    line of a slice that spans two batches)."""
    if ids.len() == 0:
        return []
    ends = (ids.slice(1) != ids.slice(0, ids.len() - 1)).arg_true()
    if ends.len() >= _MOST_RUNS:
        return None
    bounds = [0, *(int(e) + 1 for e in ends), ids.len()]
    return [(ids[a], a, b - a) for a, b in pairwise(bounds)]


def read(work_dir: Path, batch_id: str, n_requests: int) -> JsonlLines | None:
    """The batch's prepared lines (held by the open pass, or their file, read when sent), or
    None when there are no complete lines of exactly `n_requests` (the caller builds them from
    the store then)."""
    opened = _PASSES.get(work_dir.resolve())
    if opened is not None:
        held = opened.lines(batch_id)
        if held is not None and len(held) == n_requests:
            return held
    try:
        return JsonlFile(_path(work_dir, batch_id, n_requests), n_requests)
    except (OSError, ValueError):
        return None


def discard(work_dir: Path, batch_id: str) -> None:
    """The batch was sent: its lines only take space now."""
    opened = _PASSES.get(work_dir.resolve())
    if opened is not None:
        opened.forget(batch_id)
    if (work_dir / _FOLDER).is_dir():
        for path in _files(work_dir, batch_id):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
