"""The copy publishing makes of the state file: every byte as it was, kept out of the page cache."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest

from lowtide import uncached_copy
from lowtide.uncached_copy import copy_uncached

SMALL_CHUNK = 64 << 10


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several steps per file, without writing megabytes."""
    monkeypatch.setattr(uncached_copy, "CHUNK", SMALL_CHUNK)


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


def test_the_copy_is_not_left_in_the_page_cache(tmp_path: Path) -> None:
    """The point of the module: a buffered copy would leave all of it cached."""
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip(f"{tmp_path}: this filesystem has no O_DIRECT")
        raise
    source = tmp_path / "state.duckdb"
    source.write_bytes(os.urandom(4 << 20))
    to = tmp_path / "copy.duckdb"
    copy_uncached(source, to)
    cached, pages = _resident_pages(to)
    assert pages == 1024
    assert cached <= 1, f"{cached} of {pages} pages of the copy are in the page cache"
