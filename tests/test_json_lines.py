"""Reading JSON lines through DuckDB: the frame a provider's result file becomes."""

from concurrent.futures import ThreadPoolExecutor

import polars as pl
import pytest

from lowtide.json_lines import json_lines

SCHEMA = {
    "custom_id": pl.String,
    "response": pl.Struct(
        {
            "status_code": pl.Int64,
            "body": pl.Struct({"choices": pl.List(pl.Struct({"content": pl.String}))}),
        }
    ),
    "error": pl.Struct({"code": pl.String}),
}


def test_lines_become_the_schema_s_frame_extra_fields_ignored_absent_ones_null():
    content = (
        b'{"custom_id": "a", "response": {"status_code": 200, "extra": [1, 2], '
        b'"body": {"choices": [{"content": "x", "index": 0}]}}, "error": null}\n'
        b'{"custom_id": "b", "error": {"code": "batch_expired", "message": "late"}}\n'
    )
    frame = json_lines(content, SCHEMA)
    assert frame.schema == pl.Schema(SCHEMA)
    assert frame.to_dicts() == [
        {
            "custom_id": "a",
            "response": {"status_code": 200, "body": {"choices": [{"content": "x"}]}},
            "error": None,
        },
        {"custom_id": "b", "response": None, "error": {"code": "batch_expired"}},
    ]


def test_no_lines_give_an_empty_frame_of_the_schema():
    frame = json_lines(b"", SCHEMA)
    assert frame.height == 0
    assert frame.schema == pl.Schema(SCHEMA)


def test_a_broken_line_is_a_value_error_not_a_partial_frame():
    with pytest.raises(ValueError, match="unreadable JSON lines"):
        json_lines(b'{"custom_id": "a"}\n{"custom_id": \n', SCHEMA)


def test_a_line_longer_than_duckdb_s_default_limit_is_read():
    big = "y" * (20 << 20)  # DuckDB refuses objects over 16 MB unless told otherwise
    content = b'{"custom_id": "' + big.encode() + b'"}\n'
    assert json_lines(content, SCHEMA)["custom_id"].str.len_bytes().item() == len(big)


def test_threads_reading_at_once_each_get_their_own_file_s_rows(tmp_path):
    # join tasks of several batches read their results files side by side
    paths = []
    for n in range(4):
        path = tmp_path / f"results-{n}.jsonl"
        path.write_bytes(b"".join(b'{"custom_id": "%d-%d"}\n' % (n, i) for i in range(20_000)))
        paths.append(path)
    with ThreadPoolExecutor(max_workers=4) as pool:
        frames = list(pool.map(lambda p: json_lines(p, SCHEMA), paths * 3))
    for n, frame in enumerate(frames):
        assert frame["custom_id"].to_list() == [f"{n % 4}-{i}" for i in range(20_000)]


def test_a_broken_file_leaves_the_next_read_whole():
    with pytest.raises(ValueError):
        json_lines(b'{"custom_id": \n', SCHEMA)
    assert json_lines(b'{"custom_id": "a"}\n', SCHEMA)["custom_id"].to_list() == ["a"]
