"""The emulator's memory on disk: what a provider would still know after the process restarts.

With `EmulatorConfig.state_dir` set, `EmulatorState` writes a snapshot after every change a
client caused (an upload, create, cancel, delete, realtime call, clock jump, or a tick that
moved a batch to a new status) and loads it at start, resuming the simulated clock at the
snapshot's time. Batch progress is derived from the clock, so requests executed after the last
snapshot and lost with the process are executed again at the same simulated moments: the
restored state is the state at the snapshot's time, exactly, with its ledger.

Layout of the folder:

    state.pickle        the snapshot: clock, id sequence, file records, unfinished batches,
                        attempt counters, ledger, prompt cache, queue-measurement marks
                        (pickle: load only your own)
    blobs/content.<id>  a live file's content
    blobs/lines.<id>    a batch's requests, JSON (they never change after the create)
    blobs/batch.<id>    a finished batch (it never changes again)
    lock                flock'ed by the one emulator that uses the folder

A blob is written once, before the first snapshot that names it, and removed after the first
snapshot that no longer does (a deleted or expired file, a deleted message batch), so a
snapshot costs what changed since the last one plus the unfinished batches and the ledger, not
the whole history. Every write goes to a temporary name and is then `os.replace`d: a SIGKILL
mid-write leaves the previous snapshot. Nothing is fsync'ed, so a power cut may lose the
latest snapshots; a killed process loses nothing it answered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from lowtide.emulator.anthropic_batches import BatchRequest, MessageBatch
from lowtide.emulator.ledger import Execution
from lowtide.emulator.limits import QueueMarks
from lowtide.emulator.openai_batch_lifecycle import TERMINAL, BatchLine, OpenAIBatch
from lowtide.emulator.openai_files import StoredFile

log = logging.getLogger("lowtide.emulator")

SNAPSHOT_NAME = "state.pickle"
BLOBS_DIR = "blobs"
LOCK_NAME = "lock"


@dataclass
class Snapshot:
    """Everything an `EmulatorState` remembers across a restart. Faults and the config are not
    part of it: they come from whoever starts the emulator. As written, files have no content
    and batches no requests (those are blobs); `StateDir.load` returns them whole."""

    layout: str
    now: float
    next_seq: int
    files: dict[str, StoredFile]
    batches: dict[str, OpenAIBatch]  # unfinished ones here, finished ones as blobs
    message_batches: dict[str, MessageBatch]
    done_batches: list[str]
    done_message_batches: list[str]
    attempts: dict[tuple[str, str], int]
    ledger: list[tuple[Any, ...]]  # Execution fields in order (tuples pickle ~5x faster)
    prompt_cache: dict[str, float]
    queue_marks: QueueMarks


def _layout() -> str:
    """The field names of every pickled class: a snapshot written by code whose records had
    other fields is refused instead of loading objects with missing attributes."""
    classes = (
        Snapshot,
        StoredFile,
        OpenAIBatch,
        BatchLine,
        MessageBatch,
        BatchRequest,
        Execution,
        QueueMarks,
    )
    return ";".join(
        f"{cls.__name__}:{','.join(f.name for f in dataclasses.fields(cls))}" for cls in classes
    )


LAYOUT = _layout()
_LEDGER_FIELDS = [f.name for f in dataclasses.fields(Execution)]

Blobs = dict[str, Callable[[], bytes]]


def capture(
    *,
    now: float,
    next_seq: int,
    files: dict[str, StoredFile],
    batches: dict[str, OpenAIBatch],
    message_batches: dict[str, MessageBatch],
    attempts: dict[tuple[str, str], int],
    ledger: Iterable[Execution],
    prompt_cache: dict[str, float],
    queue_marks: QueueMarks,
) -> tuple[Snapshot, Blobs]:
    """The snapshot of a state at simulated time `now` (call it under the state's lock), and
    every blob it names, each as a function that serialises it (only called for blobs not yet
    on disk)."""
    blobs: Blobs = {}
    snap = Snapshot(
        layout=LAYOUT,
        now=now,
        next_seq=next_seq,
        files={},
        batches={},
        message_batches={},
        done_batches=[],
        done_message_batches=[],
        attempts=dict(attempts),
        ledger=[tuple(vars(e).values()) for e in ledger],
        prompt_cache=dict(prompt_cache),
        queue_marks=dataclasses.replace(queue_marks),
    )
    for fid, stored in files.items():
        if stored.alive(now):  # a deleted or expired file is gone at the provider too
            snap.files[fid] = dataclasses.replace(stored, content=b"")
            blobs[f"content.{fid}"] = _constant(stored.content)
    for bid, batch in batches.items():
        light = dataclasses.replace(batch, lines=[])
        blobs[f"lines.{bid}"] = _jsoner([(ln.line_no, ln.custom_id, ln.body) for ln in batch.lines])
        if batch.status in TERMINAL:
            snap.done_batches.append(bid)
            blobs[f"batch.{bid}"] = _pickler(light)
        else:
            snap.batches[bid] = light
    for bid, mbatch in message_batches.items():
        if mbatch.deleted:
            continue
        mlight = dataclasses.replace(mbatch, requests=[])
        blobs[f"lines.{bid}"] = _jsoner([(r.custom_id, r.params) for r in mbatch.requests])
        if mbatch.status == "ended":
            snap.done_message_batches.append(bid)
            blobs[f"batch.{bid}"] = _pickler(mlight)
        else:
            snap.message_batches[bid] = mlight
    return snap, blobs


def ledger_entries(snap: Snapshot) -> list[dict[str, Any]]:
    """The snapshot's ledger as keyword arguments of `BillingLedger.record`, oldest first."""
    return [dict(zip(_LEDGER_FIELDS, values, strict=True)) for values in snap.ledger]


def _constant(content: bytes) -> Callable[[], bytes]:
    return lambda: content


def _jsoner(rows: list[tuple[Any, ...]]) -> Callable[[], bytes]:
    # Requests are JSON as the client sent them; orjson writes them ~5x faster than pickle.
    return lambda: orjson.dumps(rows)


def _pickler(obj: object) -> Callable[[], bytes]:
    return lambda: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class StateDirInUse(RuntimeError):
    """Another live emulator holds the folder's lock."""


class StateDir:
    """One emulator's folder, locked (`flock`) from construction until `close()`; the kernel
    drops the lock when the process dies, so a crashed emulator never blocks the next one."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._blobs = self.path / BLOBS_DIR
        self._blobs.mkdir(parents=True, exist_ok=True)
        lock: IO[bytes] = open(self.path / LOCK_NAME, "a+b")  # noqa: SIM115 -- held until close()
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock.close()
            raise StateDirInUse(
                f"emulator state folder {self.path} is in use by another emulator process"
            ) from exc
        self._lock: IO[bytes] | None = lock
        self._on_disk: set[str] = set()

    def load(self) -> Snapshot | None:
        """The last snapshot, whole (file contents, batch requests, finished batches), or None
        when there is none or it cannot be read (it is then renamed `state.pickle.unreadable`
        and a warning is logged: the emulator starts empty, as after a provider-side loss)."""
        snap = self._read()
        keep = self._named(snap) if snap is not None else set()
        for entry in self._blobs.iterdir():
            if entry.name not in keep:  # leftovers of a crash between a blob and a snapshot
                entry.unlink(missing_ok=True)
        self._on_disk = keep
        return snap

    @staticmethod
    def _named(snap: Snapshot) -> set[str]:
        names = {f"content.{fid}" for fid in snap.files}
        for bid in [*snap.batches, *snap.message_batches]:
            names.add(f"lines.{bid}")
        for bid in [*snap.done_batches, *snap.done_message_batches]:
            names |= {f"lines.{bid}", f"batch.{bid}"}
        return names

    def _read(self) -> Snapshot | None:
        path = self.path / SNAPSHOT_NAME
        if not path.exists():
            return None
        try:
            snap = pickle.loads(path.read_bytes())
            if not isinstance(snap, Snapshot) or snap.layout != LAYOUT:
                raise ValueError("written by a version of lowtide with other emulator records")
            self._fill(snap)
        except (
            OSError,
            EOFError,
            ValueError,
            TypeError,
            AttributeError,
            ImportError,
            pickle.UnpicklingError,
            orjson.JSONDecodeError,
        ) as exc:
            self._set_aside(path, exc)
            return None
        return snap

    def _fill(self, snap: Snapshot) -> None:
        """Put the blobs back: file contents, batch requests, finished batches (in id order
        of creation, as the state held them)."""
        for fid, stored in snap.files.items():
            stored.content = self._read_blob(f"content.{fid}")
        for bid in snap.done_batches:
            snap.batches[bid] = pickle.loads(self._read_blob(f"batch.{bid}"))
        for bid in snap.done_message_batches:
            snap.message_batches[bid] = pickle.loads(self._read_blob(f"batch.{bid}"))
        for batch in snap.batches.values():
            rows = orjson.loads(self._read_blob(f"lines.{batch.id}"))
            batch.lines = [BatchLine(*row) for row in rows]
        for mbatch in snap.message_batches.values():
            rows = orjson.loads(self._read_blob(f"lines.{mbatch.id}"))
            mbatch.requests = [BatchRequest(*row) for row in rows]
        snap.batches = dict(sorted(snap.batches.items(), key=lambda kv: kv[1].seq))
        snap.message_batches = dict(sorted(snap.message_batches.items(), key=lambda kv: kv[1].seq))

    def _read_blob(self, name: str) -> bytes:
        return (self._blobs / name).read_bytes()

    def _set_aside(self, path: Path, exc: Exception) -> None:
        aside = path.with_name(SNAPSHOT_NAME + ".unreadable")
        os.replace(path, aside)
        log.warning(
            "Cannot read the emulator state in %s (%s); starting empty. The old snapshot is "
            "kept as %s.",
            self.path,
            exc,
            aside,
        )

    def save(self, snap: Snapshot, blobs: Blobs) -> None:
        """Write the blobs not yet on disk, then `snap` (the commit point), then remove the
        blobs it no longer names."""
        for name, serialise in blobs.items():
            if name not in self._on_disk:
                _write_atomic(self._blobs / name, serialise())
                self._on_disk.add(name)
        _write_atomic(
            self.path / SNAPSHOT_NAME, pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL)
        )
        for name in self._on_disk - blobs.keys():
            (self._blobs / name).unlink(missing_ok=True)
            self._on_disk.discard(name)

    def close(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
