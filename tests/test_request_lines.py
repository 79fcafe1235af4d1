"""A batch's lines stay in Arrow until they are sent; the payload is exactly the JSONL a
provider would get from joining them, whatever the text and however the column is chunked."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pytest

from lowtide.request_lines import JsonlLines, RequestLines, jsonl_payload

LINES = [
    orjson.dumps({"custom_id": f"c{i}", "body": {"messages": [{"content": text}]}}).decode()
    for i, text in enumerate(["plain", "ümlaut and €", "emoji 😀", 'a "quoted" \\ line', ""])
]


@pytest.mark.parametrize(
    "column",
    [
        pa.chunked_array([LINES]),
        pa.chunked_array([LINES[:2], LINES[2:]]),  # DuckDB hands back several chunks
        pa.chunked_array([pa.array(LINES, pa.large_string())]),
        pa.chunked_array([["x", *LINES, "y"]]).slice(1, len(LINES)),  # a view into a buffer
    ],
    ids=["one chunk", "chunks", "large strings", "sliced"],
)
def test_the_payload_is_the_lines_each_ended_by_a_newline(column: pa.ChunkedArray) -> None:
    lines = RequestLines(column)
    payload = lines.jsonl()
    assert payload == "".join(f"{line}\n" for line in LINES).encode()
    assert jsonl_payload(lines) == jsonl_payload(list(lines)) == payload
    assert list(lines) == LINES and len(lines) == len(LINES) and lines[2] == LINES[2]
    assert [orjson.loads(line)["custom_id"] for line in payload.splitlines()] == [
        f"c{i}" for i in range(len(LINES))
    ]


def test_a_missing_line_is_an_error_not_a_shorter_file() -> None:
    with pytest.raises(ValueError, match="missing"):
        RequestLines(pa.chunked_array([["a", None, "b"]])).jsonl()


def test_jsonl_lines_are_sent_as_the_payload_and_read_line_by_line() -> None:
    payload = "".join(line + "\n" for line in LINES).encode()
    lines = JsonlLines(payload)
    assert len(lines) == len(LINES)
    assert list(lines) == LINES and lines[2] == LINES[2] and lines[1:3] == LINES[1:3]
    assert jsonl_payload(lines) is payload  # sent as it is, no copy
    assert len(JsonlLines(b"")) == 0


def test_a_jsonl_payload_whose_last_line_is_cut_short_is_refused() -> None:
    with pytest.raises(ValueError, match="cut short"):
        JsonlLines(b'{"a": 1}\n{"b"')
