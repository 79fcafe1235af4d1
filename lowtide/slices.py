"""Work on a big frame a slice of rows at a time, so the copies a step makes only to measure,
hash or cut its texts are held for one slice, never for a million rows at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, TypeVar

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

Part = TypeVar("Part", pl.DataFrame, pl.Series)


def by_slices(frame: pl.DataFrame, rows: int, make: Callable[[pl.DataFrame], Part]) -> Part:
    """`make` applied to each slice of `rows` rows of `frame`, the parts concatenated in order
    (`make(frame)` itself when it fits one slice, an empty frame included)."""
    if frame.height <= rows:
        return make(frame)
    return pl.concat([make(part) for part in frame.iter_slices(rows)])


def file_slices(
    path: str | Path, rows: int, columns: list[str] | None = None
) -> Iterator[pl.DataFrame]:
    """A parquet file's rows `rows` at a time, in order (only `columns`, if given); the scan
    reads only the row groups a slice covers, so the whole file is never held. An empty file
    gives one empty slice (its columns), so whatever is written from the slices has them too."""
    total = pl.scan_parquet(path).select(pl.len()).collect().item()
    for offset in range(0, max(total, 1), rows):
        scan = pl.scan_parquet(path)
        yield (scan if columns is None else scan.select(columns)).slice(offset, rows).collect()


def as_arrow(frame: pl.DataFrame) -> pa.Table:
    """`frame` as Arrow in polars' own string layout (string views): Arrow's classic strings
    are a copy of every text (0.38 -> 0.23 s of CPU to write 200,000 rows of two texts to
    parquet). pyarrow and DuckDB both take views as they are."""
    return frame.to_arrow(compat_level=pl.CompatLevel.newest())


WORK_FILE_COMPRESSION: Final = "uncompressed"
"""How the files a run hands from stage to stage are written (polars' name; pyarrow's is
`none`). They live for one run and are read back once or twice: compressing their texts cost
six times the CPU of writing them plain (0.84 s against 0.13 s per 100k rows, snappy), and
reading them back twice as much, to save a third of a transient file's size."""


class FileWriter:
    """Frames appended to one parquet file in order, each as its own row groups, uncompressed
    (`WORK_FILE_COMPRESSION`) and without dictionary pages (texts and ids are nearly all
    distinct: trying a dictionary first cost a fifth of the write, 0.35 -> 0.27 s of CPU per
    300,000 rows); the first frame's types are the file's (later ones are cast to
    them: a slice whose column is all empty may carry a looser type). Write at least one frame,
    empty or not: it gives the file its columns."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # a new file, never the old one rewritten in place: a run's messages file is also
        # linked beside the state file (`message_files.keep`), and must not change under it
        self.path.unlink(missing_ok=True)
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def write(self, frame: pl.DataFrame) -> None:
        # no Arrow schema in the file: every reader sees plain parquet text columns, not views
        table = as_arrow(frame)
        if self._writer is None:
            self._writer = pq.ParquetWriter(
                self.path,
                table.schema,
                compression="none",
                use_dictionary=False,
                store_schema=False,
            )
        elif table.schema != self._writer.schema:
            table = table.cast(self._writer.schema)
        self._writer.write_table(table)
        self.rows += frame.height

    def close(self) -> None:
        if self._writer is None:
            raise ValueError(f"{self.path}: closed with no frame written, so it has no columns")
        self._writer.close()
