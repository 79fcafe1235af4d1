"""The write-ahead ledger's messages, kept as parquet files beside the state file.

A run's requests are stored in `requests` without their messages: dedupe already wrote every
message to send, once, to a parquet file, and that file itself is kept (linked, not copied) in
a folder beside the state file, one file per manifest written. Storing ~1 GB of messages in
DuckDB cost ~26 s of CPU per million requests (its zstd compression) and ~670 MB of state file
that stayed after every answer arrived; linking the file costs nothing, and a finished run's
file is cut down to the messages that may still be sent (`prune`).

A request's `message_file` names its file; a line is built from it when a batch is sent, as it
was built from the stored message before. Files are named `<run_id>.<token>.parquet`: a resumed
run writes a new file and never replaces one that requests of its first attempt (or of another
run that asked the same) point at.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

import polars as pl

from lowtide.slices import WORK_FILE_COMPRESSION
from lowtide.store._sql import literal

SUFFIX = ".messages"
"""The folder beside the state file: `state.duckdb` keeps its messages in `state.duckdb.messages`."""

NO_MESSAGES = (
    "(SELECT NULL::VARCHAR AS custom_id, NULL::VARCHAR AS user, NULL::VARCHAR AS message_file "
    "WHERE false)"
)


def folder_of(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + SUFFIX)


def keep(folder: Path, messages: Path, run_id: str) -> str:
    """Keep the file `messages` (columns custom_id and user, at least) in `folder` under a new
    name, durably, before any request names it; returns that name. A hard link where the work
    directory shares the disk (no copy of the texts), else a copy."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{run_id}.{secrets.token_hex(4)}.parquet"
    partial = folder / (name + ".partial")
    try:
        os.link(messages, partial)
    except OSError:  # another disk, or links not allowed
        shutil.copyfile(messages, partial)
    _fsync(partial)
    os.replace(partial, folder / name)
    _fsync(folder)
    return name


def relation(folder: Path, names: Iterable[str]) -> str:
    """SQL for (custom_id, user, message_file) of the kept files `names` (those that exist): what
    a line is built from. Only the files a query's requests name are read, so a file of another
    run, being cut down or damaged, never stands in the way."""
    files = sorted({folder / n for n in names if n and (folder / n).is_file()})
    if not files:
        return NO_MESSAGES
    paths = ", ".join(literal(str(f)) for f in files)
    return (
        "(SELECT custom_id, user, parse_filename(filename) AS message_file "
        f"FROM read_parquet([{paths}], filename = true, union_by_name = true))"
    )


def unreadable(folder: Path, stored: pl.DataFrame) -> pl.Series:
    """The custom_ids of `stored` (custom_id, message_file) whose message cannot be read from
    `folder`: their file is gone, damaged or lacks them."""
    lost = [stored.filter(pl.col("message_file").is_null())["custom_id"]]
    named = stored.filter(pl.col("message_file").is_not_null())
    for (name,), rows in named.group_by("message_file"):
        try:
            held = pl.read_parquet(folder / str(name), columns=["custom_id"])["custom_id"]
        except (OSError, pl.exceptions.PolarsError):
            held = pl.Series("custom_id", [], dtype=pl.String)
        lost.append(rows.filter(~pl.col("custom_id").is_in(held.implode()))["custom_id"])
    return pl.concat(lost)


def prunable(folder: Path, live_runs: Iterable[str]) -> list[Path]:
    """The files (kept or left half-written) no unfinished run may still be writing or sending
    from: all but those of `live_runs` (a run between keeping its file and storing the requests
    that name it is one of them). Anything else in the folder is not lowtide's and left be."""
    if not folder.is_dir():
        return []
    prefixes = tuple(f"{run}." for run in live_runs)
    ours = (f for f in folder.iterdir() if f.name.endswith((".parquet", ".partial")))
    return sorted(f for f in ours if not (prefixes and f.name.startswith(prefixes)))


def cut_to(path: Path, wanted: pl.Series) -> int:
    """Rewrite the file `path` with only the messages of `wanted` (custom_ids), or remove it when
    there are none (a leftover `.partial` too); a file holding exactly those already is left as
    it is. Returns 1 when the file changed, else 0."""
    if wanted.is_empty() or not path.name.endswith(".parquet"):
        path.unlink(missing_ok=True)
        return 1
    total = pl.scan_parquet(path).select(pl.len()).collect().item()
    if total == wanted.len():
        return 0
    kept = (
        pl.scan_parquet(path)
        .select("custom_id", "user")
        .filter(pl.col("custom_id").is_in(wanted.implode()))
        .collect()
    )
    partial = path.with_name(f"{path.name}.{secrets.token_hex(4)}.partial")
    kept.write_parquet(partial, compression=WORK_FILE_COMPRESSION)
    _fsync(partial)
    os.replace(partial, path)
    return 1


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
