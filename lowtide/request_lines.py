"""A batch's request lines as the store builds them: an Arrow column, not Python strings.

An upload needs the lines as one JSONL payload. Fetching 50,000 lines as Python strings, joining
them into one string (two or four bytes a character once one line holds a character past
Latin-1) and encoding that took the submitting process from 146 MB to 778 MB for a 50 MB file;
this way, to 459 MB (measured on the same batch). Here the
payload is made from the column's own bytes, each line with its newline appended by Arrow, and
lines are turned into Python strings only for a backend that reads them one by one (Anthropic's
inline requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, overload

import orjson
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from lowtide.uncached_files import open_uncached_reader


class RequestLines(Sequence[str]):
    """The lines of one batch, in order, each without its newline."""

    def __init__(self, column: pa.ChunkedArray | pa.Array) -> None:
        self._column = column if isinstance(column, pa.ChunkedArray) else pa.chunked_array([column])

    def __len__(self) -> int:
        return len(self._column)

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return self._column[index].to_pylist()
        return self._column[index].as_py()

    def __iter__(self) -> Iterator[str]:
        for chunk in self._column.chunks:
            yield from chunk.to_pylist()

    def jsonl(self) -> bytes:
        """The lines as one JSONL payload, each ended by a newline."""
        return b"".join(ended_lines(chunk) for chunk in self._column.chunks)


def json_string(column: str) -> pl.Expr:
    """Each text of `column` as a JSON string, quotes included, escaped by polars in compiled
    code (a null becomes `null`)."""
    # struct.json_encode gives {"<column>":"<escaped>"}; the slice keeps the quoted string
    key = len(orjson.dumps(column)) + 2
    return pl.struct(column).struct.json_encode().str.slice(key).str.head(-1)


def ended_lines(lines: pa.Array) -> pa.Buffer:
    """Arrow string lines as JSONL bytes, each line ended by a newline: one copy of their
    bytes, made by Arrow."""
    ended = pc.binary_join_element_wise(
        lines, pa.scalar("", lines.type), pa.scalar("\n", lines.type)
    )
    return joined(ended)


def joined(lines: pa.Array) -> pa.Buffer:
    """The bytes of Arrow string `lines` back to back, as they lie in its values buffer (no
    copy): a JSONL payload when each line already ends with its newline."""
    if lines.null_count:
        raise ValueError("a request line is missing (null)")
    # the values buffer from the first line's start to the last one's end
    width = pa.int64() if pa.types.is_large_string(lines.type) else pa.int32()
    offsets = pa.Array.from_buffers(
        width, len(lines) + 1, [None, lines.buffers()[1]], offset=lines.offset
    )
    return lines.buffers()[2][offsets[0].as_py() : offsets[-1].as_py()]


class JsonlLines(Sequence[str]):
    """The lines of one batch as the JSONL payload itself (every line ended by a newline):
    sent as they are, split into lines only for a backend that reads them one by one."""

    def __init__(self, payload: bytes, count: int | None = None) -> None:
        """`count`: the number of lines, when its writer said (counting them reads ~1 GB at a
        million requests)."""
        if payload and not payload.endswith(b"\n"):
            raise ValueError("JSONL payload cut short: its last line has no newline")
        if count is not None and len(payload) < count:  # every line holds its newline at least
            raise ValueError(f"JSONL payload of {len(payload)} bytes cannot hold {count} lines")
        self._payload = payload
        self._count = payload.count(b"\n") if count is None else count
        self._lines: list[str] | None = None

    def _split(self) -> list[str]:
        if self._lines is None:
            self._lines = self.jsonl().decode("utf-8").split("\n")[:-1]
        return self._lines

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self._split()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._split())

    def jsonl(self) -> bytes:
        return self._payload


class JsonlFile(JsonlLines):
    """The lines of one batch as a JSONL file (every line ended by a newline), read only when
    they are needed: an upload streams the file (`open`). Reading a ~75 MB payload whole for
    each of a 1M night's batches cost 4.5 s of CPU, nearly all of it the kernel giving the
    fresh buffers their pages; streamed a piece at a time, 0.2 s."""

    def __init__(self, path: Path, count: int) -> None:
        size = path.stat().st_size
        if size < count:  # every line holds its newline at least
            raise ValueError(f"{path}: {size} bytes cannot hold {count} lines")
        with path.open("rb") as f:
            if size and (f.seek(size - 1), f.read(1))[1] != b"\n":
                raise ValueError(f"{path}: cut short, its last line has no newline")
        self.path = path
        self._count = count
        self._lines = None

    def open(self) -> BinaryIO:
        """The payload as a binary file, to be sent as it is (read past the page cache: it is
        read once, `uncached_files`)."""
        return open_uncached_reader(self.path)

    def jsonl(self) -> bytes:
        return self.path.read_bytes()


def jsonl_payload(lines: Iterable[str]) -> bytes:
    """`lines` as one JSONL payload: as they are for lines held as Arrow or JSONL bytes."""
    if isinstance(lines, RequestLines | JsonlLines):
        return lines.jsonl()
    return "".join(line + "\n" for line in lines).encode("utf-8")
