"""Big files written and read past the page cache (O_DIRECT).

A run writes gigabytes it reads at most once: the state file's published copy (1.8 GB at a
million rows) and the request files uploaded once each (1.6 GB). Written the usual way, every
byte lands in a fresh page-cache page, and on the virtual machines we run on memory the guest
left free is handed back to the host, so the first touch of such a page costs microseconds in
the kernel. Measured here on a 1.9 GB file written and synced a few seconds before:
`shutil.copyfile` 4.1-4.9 s of kernel CPU, the same copy written O_DIRECT from one reused buffer
0.3 s (1.2-1.4 s of wall time). Here one small buffer, mapped once, carries every byte.

O_DIRECT wants offsets, lengths and buffers aligned to the disk's block: whole chunks are
written and read at multiples of `_ALIGN` from a page-aligned mapping, and a file's tail that
is not a whole block is written through the cache. Where the filesystem refuses O_DIRECT
(opening with it fails, or a write is refused as misaligned), the plain way is taken.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import shutil
from pathlib import Path
from typing import BinaryIO

CHUNK = 8 << 20
"""Bytes per step of a copy; a multiple of `_ALIGN`."""

STREAM_CHUNK = 1 << 20
"""The buffer of a file written or read a piece at a time: small, as a run may hold one per
batch open at once (twenty at a million rows)."""

_ALIGN = 4096
"""Offsets and lengths of O_DIRECT transfers are kept multiples of this (the largest logical
block size of the disks we meet); a mapping is aligned to a page."""

_FLAGS_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC

_DIRECT = getattr(os, "O_DIRECT", 0)
"""Linux's flag; 0 where the platform has none (macOS): every file then takes the plain way."""


def _open_direct(path: Path, flags: int) -> int | None:
    """`path` opened with O_DIRECT added; None where its filesystem has no O_DIRECT."""
    if not _DIRECT:
        return None
    try:
        return os.open(path, flags | _DIRECT, 0o666)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None


def _cached_from_now(fd: int) -> None:
    """Take O_DIRECT off `fd`: what is written next goes through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_DIRECT)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


class _DirectOutput:
    """Writes at increasing offsets of a file opened O_DIRECT: whole blocks directly, and from
    the first piece that is not (the file's tail), or the first write the filesystem refuses as
    misaligned, everything through the cache."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct = True

    def write(self, data: memoryview, offset: int) -> None:
        head = len(data) - len(data) % _ALIGN if self.direct else 0
        if head:
            try:
                _write_all(self.fd, data[:head], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                head = 0  # written again below, through the cache
        if head < len(data):
            if self.direct:
                _cached_from_now(self.fd)
                self.direct = False
            _write_all(self.fd, data[head:], offset + head)


def copy_uncached(source: Path, to: Path) -> None:
    """Copy `source` to a new file `to` (replaced if present), written past the page cache;
    `source` is read through it (where the state file already lies). OSError as
    `shutil.copyfile` raises it."""
    out = _open_direct(to, _FLAGS_NEW)
    if out is None:
        shutil.copyfile(source, to)
        return
    buffer = mmap.mmap(-1, CHUNK)
    try:
        with source.open("rb") as src:
            _copy_into(src.fileno(), _DirectOutput(out), buffer)
    finally:
        os.close(out)
        _unmap(buffer)


def _copy_into(src: int, output: _DirectOutput, buffer: mmap.mmap) -> None:
    view = memoryview(buffer)
    try:
        offset = 0
        while read := os.preadv(src, [buffer], offset):
            output.write(view[:read], offset)
            offset += read
    finally:
        view.release()


def _unmap(buffer: mmap.mmap) -> None:
    """Close a mapping, or leave it to be unmapped with its last view: a failed write (a full
    disk) leaves views of it in the traceback, and closing it then would raise BufferError in
    place of the error that says what went wrong."""
    with contextlib.suppress(BufferError):
        buffer.close()


class UncachedWriter(io.RawIOBase):
    """A new file written past the page cache: what `write` is given is gathered in a mapped
    buffer and written a whole buffer at a time; `close` writes the rest."""

    def __init__(self, path: Path, fd: int) -> None:
        super().__init__()
        self.name = str(path)
        self._output = _DirectOutput(fd)
        self._buffer = mmap.mmap(-1, STREAM_CHUNK)
        self._view = memoryview(self._buffer)
        self._filled = 0
        self._offset = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        piece = memoryview(data).cast("B")
        size = len(piece)
        while piece:
            take = min(len(piece), STREAM_CHUNK - self._filled)
            self._view[self._filled : self._filled + take] = piece[:take]
            self._filled += take
            piece = piece[take:]
            if self._filled == STREAM_CHUNK:
                self._flush()
        return size

    def _flush(self) -> None:
        self._output.write(self._view[: self._filled], self._offset)
        self._offset += self._filled
        self._filled = 0

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._filled:
                self._flush()
        finally:
            self._view.release()
            _unmap(self._buffer)
            os.close(self._output.fd)
            super().close()


def open_uncached_writer(path: Path) -> BinaryIO:
    """A new binary file at `path` (replaced if present), written past the page cache where
    its filesystem allows, else the usual way."""
    fd = _open_direct(path, _FLAGS_NEW)
    if fd is None:
        return path.open("wb")
    return UncachedWriter(path, fd)  # type: ignore[return-value]


class UncachedReader(io.RawIOBase):
    """A file read past the page cache, a mapped buffer at a time, and seekable (an upload
    starts again from the beginning when retried, and learns the size by seeking to the end).
    It has no `fileno`: whoever reads must read through it."""

    def __init__(self, path: Path, fd: int) -> None:
        super().__init__()
        self.name = str(path)
        self._fd = fd
        self._size = os.fstat(fd).st_size
        self._buffer = mmap.mmap(-1, STREAM_CHUNK)
        self._view = memoryview(self._buffer)
        self._start = 0  # file offset of the buffer's first byte
        self._held = 0  # bytes of the file in the buffer
        self._position = 0
        self._direct = True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._position, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"{self.name}: seek before the start")
        self._position = base + offset
        return self._position

    def read(self, size: int | None = -1) -> bytes:
        """Up to `size` bytes (fewer where the buffer ends), copied once."""
        if size is None or size < 0:
            return self.readall()
        piece = self._held_piece(size)
        data = bytes(piece)
        self._position += len(data)
        return data

    def readinto(self, into: bytearray | memoryview) -> int:  # type: ignore[override]
        piece = self._held_piece(len(into))
        memoryview(into).cast("B")[: len(piece)] = piece
        self._position += len(piece)
        return len(piece)

    def _held_piece(self, size: int) -> memoryview:
        """Up to `size` bytes from the position on, in the buffer (filled first if need be)."""
        if self._position >= self._size or size == 0:
            return self._view[:0]
        if not self._start <= self._position < self._start + self._held:
            self._fill(self._position - self._position % _ALIGN)
        at = self._position - self._start
        return self._view[at : at + min(size, self._held - at)]

    def _fill(self, start: int) -> None:
        try:
            held = os.preadv(self._fd, [self._buffer], start)
        except OSError as e:
            if e.errno != errno.EINVAL or not self._direct:
                raise
            _cached_from_now(self._fd)  # a filesystem that takes the flag, not the reads
            self._direct = False
            held = os.preadv(self._fd, [self._buffer], start)
        if held <= self._position - start:
            raise OSError(errno.EIO, f"{self.name}: shorter than its {self._size} bytes")
        self._start, self._held = start, held

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._view.release()
            _unmap(self._buffer)
        finally:
            os.close(self._fd)
            super().close()


def open_uncached_reader(path: Path) -> BinaryIO:
    """`path` opened to be read once, past the page cache where its filesystem allows."""
    fd = _open_direct(path, os.O_RDONLY)
    if fd is None:
        return path.open("rb")
    return UncachedReader(path, fd)  # type: ignore[return-value]
