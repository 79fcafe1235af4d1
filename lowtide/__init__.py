"""lowtide: a fixed prompt over every row of a dataset, through the cheapest engine that fits."""

from lowtide import allocators  # noqa: F401 - before DuckDB or polars load: their allocators
