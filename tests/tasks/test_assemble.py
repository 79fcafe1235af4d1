from __future__ import annotations

import orjson
import polars as pl
import pytest

from lowtide.errors import LowtideError
from lowtide.jobspec import load_job
from lowtide.store import Store
from tasks import assemble
from tasks.assemble import (
    cut_shards,
    estimate_input_tokens,
    line_bytes,
    line_template,
    openai_lines,
    plan_batches,
    sized_requests,
    template_id,
)
from tests.conftest import SAMPLE_JOB
from tests.sql import query, scalar


@pytest.fixture
def job():
    return load_job(SAMPLE_JOB)


def _requests(users: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "custom_id": [f"lt1_{i:04d}" for i in range(len(users))],
            "request_key": [str(i) for i in range(len(users))],
            "user": users,
            "unit_tokens": [None] * len(users),
        },
        schema_overrides={"unit_tokens": pl.Int32},
    )


def _manifest(
    job, store: Store, requests: pl.DataFrame, messages=None, max_requests: int = 50_000
) -> pl.DataFrame:
    """Plan `requests` and write their manifest to a real store; the planned batches."""
    reqs, batches, members = plan_batches(
        job,
        "run1",
        requests,
        backend="emulator",
        max_requests=max_requests,
        max_bytes=200 * 2**20,
    )
    store.save_template(template_id(job), *line_template(job))
    store.write_manifest("run1", reqs, batches, members, messages=messages)
    return batches


def _sent_lines(store: Store, batches: pl.DataFrame) -> list[str]:
    """The batches' lines as they are sent."""
    return [line for b in batches["batch_id"] for line in store.batch_lines(b)]


def _stored_lines(job, tmp_path, users: list[str]) -> tuple[list[dict], pl.DataFrame]:
    """Plan, write the manifest to a real store, and read the lines back as they are sent."""
    store = Store(tmp_path / "state.duckdb")
    batches = _manifest(job, store, _requests(users))
    return [orjson.loads(line) for line in _sent_lines(store, batches)], batches


def test_lines_are_openai_batch_requests_with_a_fixed_prefix(job, tmp_path) -> None:
    users = ['He said "hi"\n\tthen left 🙂', "Zoë\\n", "plain", "\x00\x1f ctrl"]
    lines, batches = _stored_lines(job, tmp_path, users)
    assert [line["custom_id"] for line in lines] == [f"lt1_{i:04d}" for i in range(4)]
    assert {line["method"] for line in lines} == {"POST"}
    assert {line["url"] for line in lines} == {"/v1/chat/completions"}
    assert [line["body"]["messages"][-1]["content"] for line in lines] == users
    prefixes = {orjson.dumps(line["body"]["messages"][:-1]) for line in lines}
    assert len(prefixes) == 1  # identical system + few-shot prefix in every request
    body = lines[0]["body"]
    assert body["model"] == job.model.name and body["max_tokens"] == job.model.max_tokens
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["strict"] is True
    assert body["response_format"]["json_schema"]["schema"] == job.output_schema
    assert batches.height == 1


@pytest.mark.parametrize("slice_rows", [50_000, 2])  # measured a slice at a time, or not
def test_line_sizes_are_known_without_building_lines(job, monkeypatch, slice_rows) -> None:
    monkeypatch.setattr(assemble, "_SLICE_ROWS", slice_rows)
    reqs = _requests(['He said "hi"\n\tthen left 🙂', "Zoë", "x" * 500, "", "\x01 ctl"])
    built = openai_lines(job, reqs)
    assert line_bytes(job, reqs).to_list() == built.str.len_bytes().to_list()
    contents = [orjson.loads(b)["body"]["messages"][-1]["content"] for b in built]
    assert contents == reqs["user"].to_list()


def test_estimate_counts_the_shared_prompt(job) -> None:
    reqs, _, _ = plan_batches(
        job,
        "r",
        _requests(["a short message"]),
        backend="openai",
        max_requests=10,
        max_bytes=10**6,
    )
    assert reqs["est_input_tokens"][0] > 300  # the ~400-word system prompt and examples


def test_extra_body_is_passed_verbatim(job) -> None:
    job.model.extra_body = {"enable_thinking": False, "seed": 7}
    body = orjson.loads(openai_lines(job, _requests(["x"]))[0])["body"]
    assert body["enable_thinking"] is False and body["seed"] == 7


@pytest.mark.parametrize(
    "n,size,max_req,max_bytes",
    [(10, 100, 3, 10_000), (10, 100, 50, 350), (1, 10, 5, 100), (7, 50, 7, 10**6)],
)
def test_shards_respect_request_and_byte_limits(n, size, max_req, max_bytes) -> None:
    shard = cut_shards(pl.Series([size] * n), max_req, max_bytes)
    frame = pl.DataFrame({"shard": shard, "b": [size + 1] * n})
    per = frame.group_by("shard").agg(pl.len(), pl.col("b").sum())
    assert (per["len"] <= max_req).all()
    assert (per["b"] <= max_bytes).all()
    assert shard.to_list() == sorted(shard.to_list())  # contiguous


def test_requests_sized_from_their_file_match_the_sizes_of_held_messages(job, tmp_path) -> None:
    users = ['He said "hi"\n\tthen left 🙂', "Zoë\\n", "plain", "x" * 700, "\x00\x1f ctrl"] * 3
    requests = _requests(users).with_columns(pl.lit(False).alias("urgent"))
    path = tmp_path / "to_send.parquet"
    requests.write_parquet(path, row_group_size=2)  # read back in several pieces
    sized = sized_requests(job, path)
    assert sized["custom_id"].to_list() == requests["custom_id"].to_list()
    assert sized["_bytes"].to_list() == line_bytes(job, requests).to_list()
    assert sized["est_input_tokens"].equals(estimate_input_tokens(job, requests))


def test_messages_left_in_their_file_give_the_same_manifest(job, tmp_path) -> None:
    users = ['He said "hi"\n\tthen left 🙂', "Zoë\\n", "plain", "x" * 700, "\x00\x1f ctrl"] * 2
    requests = _requests(users).with_columns(pl.lit(False).alias("urgent"))
    path = tmp_path / "to_send.parquet"
    requests.write_parquet(path, row_group_size=3)

    whole, apart = Store(tmp_path / "whole.duckdb"), Store(tmp_path / "apart.duckdb")
    held = _manifest(job, whole, requests.drop("urgent"), max_requests=3)
    sized = sized_requests(job, path).drop("urgent")
    read = _manifest(job, apart, sized, messages=path, max_requests=3)
    assert read.drop("batch_id").equals(held.drop("batch_id"))  # same shards, sizes, counts
    columns = "custom_id, request_key, template_id, est_input_tokens, line"
    stored = [
        query(s, f"SELECT {columns} FROM requests ORDER BY custom_id") for s in (whole, apart)
    ]
    assert stored[0].equals(stored[1])
    # the messages stay in their file, kept beside the state file: not a copy in the table
    kept = query(apart, "SELECT DISTINCT message_file, user_message FROM requests")
    assert kept["user_message"].to_list() == [None]
    assert [f.name for f in apart.messages_dir.iterdir()] == kept["message_file"].to_list()
    lines = [_sent_lines(whole, held), _sent_lines(apart, read)]
    assert lines[0] == lines[1] and len(lines[1]) == len(users)


@pytest.mark.parametrize("missing", ["absent", "null"])
def test_a_request_without_its_message_in_the_file_writes_nothing(job, tmp_path, missing) -> None:
    requests = _requests(["a", "b", "c"]).with_columns(pl.lit(False).alias("urgent"))
    path = tmp_path / "to_send.parquet"
    requests.write_parquet(path)
    sized = sized_requests(job, path).drop("urgent")  # then the file loses a message
    if missing == "absent":
        requests.head(2).write_parquet(path)  # "c" is no longer in the file
    else:
        requests.with_columns(
            pl.when(pl.col("custom_id") == "lt1_0002").then(None).otherwise("user").alias("user")
        ).write_parquet(path)
    store = Store(tmp_path / "state.duckdb")
    with pytest.raises(LowtideError, match="1 request"):
        _manifest(job, store, sized, messages=path)
    assert scalar(store, "SELECT count(*) FROM requests") == 0
    assert scalar(store, "SELECT count(*) FROM batches") == 0


def test_requests_with_neither_line_nor_message_nor_file_are_refused(job, tmp_path) -> None:
    requests = _requests(["a"]).with_columns(pl.lit(False).alias("urgent"))
    path = tmp_path / "to_send.parquet"
    requests.write_parquet(path)
    with pytest.raises(LowtideError, match="no line, no message"):
        _manifest(job, Store(tmp_path / "state.duckdb"), sized_requests(job, path).drop("urgent"))
