"""Files written and read past the page cache (the published copy of the state file, the request
files): every byte as it was, none of it left in the cache."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import resource
import signal
from pathlib import Path

import polars as pl
import pytest

from lowtide import uncached_files
from lowtide.uncached_files import copy_uncached, open_uncached_reader, open_uncached_writer

SMALL_CHUNK = 64 << 10

DIRECT = getattr(os, "O_DIRECT", 0)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several steps per file, without writing megabytes."""
    monkeypatch.setattr(uncached_files, "CHUNK", SMALL_CHUNK)


@pytest.mark.parametrize(
    "size", [0, 1, 4095, 4096, SMALL_CHUNK, SMALL_CHUNK + 1, 3 * SMALL_CHUNK + 4096 + 17]
)
def test_the_copy_holds_every_byte(tmp_path: Path, small_chunks: None, size: int) -> None:
    source = tmp_path / "state.duckdb"
    source.write_bytes(os.urandom(size))
    to = tmp_path / "copy.duckdb"
    copy_uncached(source, to)
    assert to.read_bytes() == source.read_bytes()


def test_a_file_already_there_is_replaced_whole(tmp_path: Path, small_chunks: None) -> None:
    source = tmp_path / "state.duckdb"
    source.write_bytes(os.urandom(SMALL_CHUNK + 100))
    to = tmp_path / "copy.duckdb"
    to.write_bytes(b"x" * (5 * SMALL_CHUNK))
    copy_uncached(source, to)
    assert to.read_bytes() == source.read_bytes()


def test_a_missing_source_raises_and_a_missing_folder_too(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        copy_uncached(tmp_path / "absent.duckdb", tmp_path / "copy.duckdb")
    source = tmp_path / "state.duckdb"
    source.write_bytes(b"abc")
    with pytest.raises(FileNotFoundError):
        copy_uncached(source, tmp_path / "no-such-folder" / "copy.duckdb")


def _resident_pages(path: Path) -> tuple[int, int]:
    """(pages of `path` in the page cache, pages in all), by mincore(2) over a mapping of it
    (mapping reads nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    with path.open("rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            pytest.skip(f"mmap: {os.strerror(ctypes.get_errno())}")
        try:
            if libc.mincore(address, size, vector) != 0:
                pytest.skip(f"mincore: {os.strerror(ctypes.get_errno())}")
        finally:
            libc.munmap(address, size)
    return sum(v & 1 for v in vector), pages


def test_neither_the_copy_nor_a_written_file_is_left_in_the_page_cache(tmp_path: Path) -> None:
    """The point of the module: buffered, every page of both would be left cached."""
    probe = tmp_path / "probe"
    if not DIRECT:
        pytest.skip("this platform has no O_DIRECT")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | DIRECT))
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip(f"{tmp_path}: this filesystem has no O_DIRECT")
        raise
    source = tmp_path / "state.duckdb"
    source.write_bytes(os.urandom(4 << 20))
    to = tmp_path / "copy.duckdb"
    copy_uncached(source, to)
    written = tmp_path / "batch.partial"
    with open_uncached_writer(written) as f:
        for _ in range(4):
            f.write(os.urandom(1 << 20))
    for path in (to, written):
        cached, pages = _resident_pages(path)
        assert pages == 1024
        assert cached <= 1, f"{cached} of {pages} pages of {path.name} are in the page cache"


@pytest.fixture
def small_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(uncached_files, "STREAM_CHUNK", SMALL_CHUNK)


def test_a_file_written_in_pieces_holds_them_in_order(tmp_path: Path, small_streams: None) -> None:
    pieces = [os.urandom(n) for n in (0, 1, 4095, SMALL_CHUNK, 3 * SMALL_CHUNK + 7, 100)]
    path = tmp_path / "batch.partial"
    with open_uncached_writer(path) as f:
        for piece in pieces:
            assert f.write(piece) == len(piece)
    assert path.read_bytes() == b"".join(pieces)


def test_polars_writes_the_same_lines_as_to_a_plain_file(
    tmp_path: Path, small_streams: None
) -> None:
    lines = pl.DataFrame(
        {"line": [f'{{"custom_id": "r{i}", "text": "{"x" * (i % 300)}"}}' for i in range(5000)]}
    )
    plain, uncached = tmp_path / "plain.jsonl", tmp_path / "uncached.jsonl"
    with plain.open("wb") as f:
        lines.write_csv(f, include_header=False, quote_style="never")
    with open_uncached_writer(uncached) as f:
        lines.write_csv(f, include_header=False, quote_style="never")
    assert uncached.read_bytes() == plain.read_bytes()
    assert uncached.stat().st_size > 4 * SMALL_CHUNK


def test_a_reader_streams_seeks_and_tells_its_size(tmp_path: Path, small_streams: None) -> None:
    data = os.urandom(3 * SMALL_CHUNK + 4096 + 5)
    path = tmp_path / "batch.jsonl"
    path.write_bytes(data)
    with open_uncached_reader(path) as f:
        assert f.seek(0, os.SEEK_END) == len(data)  # how an upload learns the length
        assert f.tell() == len(data)
        assert f.read(10) == b""
        f.seek(0)
        read = []
        while chunk := f.read(64 * 1024 + 3):
            read.append(chunk)
        assert b"".join(read) == data
        for start in (SMALL_CHUNK - 2, 2 * SMALL_CHUNK - 4096 - 2):  # across a buffer's end
            f.seek(start)
            into = bytearray(10)
            got = 0
            while got < 10:
                got += f.readinto(memoryview(into)[got:])
            assert bytes(into) == data[start : start + 10]
        f.seek(0)
        assert f.read() == data


def test_a_file_cut_short_while_read_is_an_error_not_a_short_payload(
    tmp_path: Path, small_streams: None
) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_bytes(os.urandom(2 * SMALL_CHUNK))
    with open_uncached_reader(path) as f:
        os.truncate(path, SMALL_CHUNK)
        f.seek(SMALL_CHUNK + 10)
        with pytest.raises(OSError, match="shorter than"):
            f.read(10)


def _no_direct_io(monkeypatch: pytest.MonkeyPatch, *, at: str) -> None:
    """A filesystem without O_DIRECT: refused when opening (`at="open"`), or when writing or
    reading with it (`at="transfer"`); or a platform without the flag (`at="platform"`)."""
    if at == "platform":
        monkeypatch.setattr(uncached_files, "_DIRECT", 0)
        return
    real_open, real_pwrite, real_preadv = os.open, os.pwrite, os.preadv

    def direct(fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & DIRECT)

    def refusing_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if at == "open" and flags & DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    def refusing_pwrite(fd: int, data: object, offset: int) -> int:
        if direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    def refusing_preadv(fd: int, buffers: object, offset: int) -> int:
        if direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(uncached_files.os, "open", refusing_open)
    if at == "transfer":
        monkeypatch.setattr(uncached_files.os, "pwrite", refusing_pwrite)
        monkeypatch.setattr(uncached_files.os, "preadv", refusing_preadv)


@pytest.mark.parametrize("at", ["open", "transfer", "platform"])
def test_without_direct_io_every_file_is_written_and_read_the_plain_way(
    tmp_path: Path,
    small_chunks: None,
    small_streams: None,
    monkeypatch: pytest.MonkeyPatch,
    at: str,
) -> None:
    data = os.urandom(2 * SMALL_CHUNK + 4096 + 3)
    source = tmp_path / "state.duckdb"
    source.write_bytes(data)
    _no_direct_io(monkeypatch, at=at)
    copy = tmp_path / "copy.duckdb"
    copy_uncached(source, copy)
    assert copy.read_bytes() == data
    written = tmp_path / "batch.jsonl"
    with open_uncached_writer(written) as f:
        f.write(data[:5])
        f.write(data[5:])
    assert written.read_bytes() == data
    with open_uncached_reader(written) as f:
        assert f.read() == data


def test_a_write_that_fails_raises_its_own_error(
    tmp_path: Path, small_chunks: None, small_streams: None
) -> None:
    """Not a BufferError from closing the buffer the failed write still had views of."""
    source = tmp_path / "state.duckdb"
    source.write_bytes(os.urandom(4 * SMALL_CHUNK))
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (SMALL_CHUNK + 4096, limit[1]))
    try:
        with pytest.raises(OSError) as copying:
            copy_uncached(source, tmp_path / "copy.duckdb")
        # the close writes what the buffer holds last
        with pytest.raises(OSError) as writing, open_uncached_writer(tmp_path / "out") as f:
            f.write(source.read_bytes())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, previous)
    assert copying.value.errno == errno.EFBIG
    assert writing.value.errno == errno.EFBIG
