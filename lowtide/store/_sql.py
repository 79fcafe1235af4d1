"""The one place that turns names and values into SQL text.

Values travel as query parameters wherever DuckDB takes them; these helpers are for the few spots
where it cannot (identifiers, ATTACH/COPY paths, JSON paths inside generated view SQL). Nothing
else in lowtide builds quoted SQL by hand.
"""

from __future__ import annotations

from collections.abc import Iterable


def ident(name: str) -> str:
    """A double-quoted SQL identifier; any character in the name is safe."""
    return '"' + name.replace('"', '""') + '"'


def literal(value: str) -> str:
    """A single-quoted SQL string literal; any character in the value is safe."""
    return "'" + value.replace("'", "''") + "'"


def literal_list(values: Iterable[str]) -> str:
    """`('a', 'b')` for a fixed set of known strings (statuses), never a Python tuple repr,
    which breaks on a single element."""
    items = [literal(v) for v in values]
    if not items:
        raise ValueError("an SQL IN list needs at least one value")
    return "(" + ", ".join(items) + ")"


def json_path(field: str) -> str:
    """A quoted SQL literal for the JSON path of a top-level field (any characters in the name)."""
    return literal('$."' + field.replace("\\", "\\\\").replace('"', '\\"') + '"')
