"""The tables of docs/reliability.md: each is written by the test module that measures it."""

from __future__ import annotations

from tests.conftest import REPO


def write_section(name: str, title: str, body: str) -> None:
    """Replace the section marked `<!-- NAME:start … -->` … `<!-- NAME:end -->` with `body`, or
    add it at the end under `## TITLE`; the marker names tests/integration/test_NAME.py."""
    doc = REPO / "docs" / "reliability.md"
    text = doc.read_text()
    start = f"<!-- {name}:start (written by tests/integration/test_{name}.py) -->"
    end = f"<!-- {name}:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text:
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{block}\n"
    doc.write_text(text)
