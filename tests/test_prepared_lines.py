"""Lines prepared for sending in one pass are the very lines the store builds per batch (in the
order the pass met them), sent as the file's bytes, and a file that is missing, unfinished,
stale or short is never sent in their place."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import polars as pl
import pytest

from lowtide import prepared_lines
from lowtide.backends.openai_batch import OpenAIBatchBackend
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.jobspec import load_job
from lowtide.request_lines import JsonlFile
from lowtide.store import Store
from tasks.assemble import sized_requests
from tests.conftest import SAMPLE_JOB
from tests.emulator.conftest import TEST_CONFIG, admin, openai_client, set_faults
from tests.tasks.test_assemble import _manifest, _requests

USERS = ['He said "hi"\n\tthen left 🙂', "Zoë\\n", "plain", "\x00\x1f ctrl", "€" * 300, ""] * 3


@pytest.fixture(params=["table", "messages file"])
def planned(tmp_path, request):
    """A real store with a manifest of 18 requests in 6 batches of 3, their messages stored in
    the requests table (lines built by DuckDB) or left in a messages file (built by polars)."""
    store, job = Store(tmp_path / "state.duckdb"), load_job(SAMPLE_JOB)
    if request.param == "table":
        batches = _manifest(job, store, _requests(USERS), max_requests=3)
    else:
        path = tmp_path / "to_send.parquet"
        _requests(USERS).with_columns(pl.lit(False).alias("urgent")).write_parquet(
            path, row_group_size=4
        )
        sized = sized_requests(job, path).drop("urgent")
        batches = _manifest(job, store, sized, messages=path, max_requests=3)
        assert any(store.messages_dir.iterdir())  # kept beside the state, not in the table
    assert batches.height == 6
    return store, batches, tmp_path / "work"


def _counts(batches) -> dict[str, int]:
    return dict(zip(batches["batch_id"], batches["n_requests"], strict=True))


def _same_lines(prepared, built) -> bool:
    """The same lines, each once, whatever their order; the payload is exactly those lines."""
    payload = prepared.jsonl()
    return (
        sorted(prepared) == sorted(built)
        and payload == "".join(line + "\n" for line in prepared).encode()
        and all(orjson.loads(line)["custom_id"] for line in prepared)
    )


def test_prepared_lines_are_the_lines_the_store_builds(planned) -> None:
    store, batches, work = planned
    prepared_lines.prepare(store, work, batches["batch_id"].to_list())
    for batch_id, n in _counts(batches).items():
        lines = prepared_lines.read(work, batch_id, n)
        assert lines is not None, f"{batch_id}: no prepared lines"
        assert len(lines) == n
        assert _same_lines(lines, store.batch_lines(batch_id))
    assert sorted(p.name for p in (work / "lines").iterdir()) == sorted(
        f"{b}.{n}.jsonl" for b, n in _counts(batches).items()
    )  # each named with its count of lines; nothing unfinished left beside them


@pytest.mark.parametrize("most_runs", [0, 64])
def test_lines_in_runs_or_interleaved_reach_their_batch(planned, monkeypatch, most_runs) -> None:
    """Whether a slice's lines are written run by run or gathered per batch (past
    `_MOST_RUNS`), each batch's file holds exactly its lines."""
    store, batches, work = planned
    monkeypatch.setattr(prepared_lines, "_MOST_RUNS", most_runs)
    prepared_lines.prepare(store, work, batches["batch_id"].to_list())
    for batch_id, n in _counts(batches).items():
        lines = prepared_lines.read(work, batch_id, n)
        assert lines is not None and _same_lines(lines, store.batch_lines(batch_id))


def test_runs_of_one_batch_are_found_in_order(monkeypatch) -> None:
    ids = pl.Series(["a", "a", "b", "b", "b", "a"])
    assert prepared_lines._runs(ids) == [("a", 0, 2), ("b", 2, 3), ("a", 5, 1)]
    assert prepared_lines._runs(pl.Series([], dtype=pl.String)) == []
    monkeypatch.setattr(prepared_lines, "_MOST_RUNS", 2)
    assert prepared_lines._runs(ids) is None  # too many runs: filtered per batch instead


def test_a_missing_short_or_unfinished_file_is_not_used(planned) -> None:
    store, batches, work = planned
    ids = batches["batch_id"].to_list()
    prepared_lines.prepare(store, work, ids)
    first, second, third = ids[:3]
    assert prepared_lines.read(work, first, 4) is None  # the batch row says another count
    prepared_lines.discard(work, second)
    assert prepared_lines.read(work, second, 3) is None
    done = work / "lines" / f"{third}.3.jsonl"
    done.rename(work / "lines" / f"{third}.partial")  # as a crash mid-write leaves it
    assert prepared_lines.read(work, third, 3) is None
    cut = work / "lines" / f"{ids[3]}.3.jsonl"
    cut.write_bytes(cut.read_bytes()[:-5])  # three lines begun, the last one cut short
    assert prepared_lines.read(work, ids[3], 3) is None
    (work / "lines" / f"{ids[4]}.3.jsonl").write_bytes(b"")  # as a full disk leaves it
    assert prepared_lines.read(work, ids[4], 3) is None


def test_an_earlier_attempts_file_is_replaced(planned) -> None:
    store, batches, work = planned
    ids = batches["batch_id"].to_list()
    (work / "lines").mkdir(parents=True)
    (work / "lines" / f"{ids[0]}.3.jsonl").write_bytes(b"{}\n{}\n{}\n")
    (work / "lines" / f"{ids[1]}.partial").write_bytes(b"{}\n")
    prepared_lines.prepare(store, work, ids)
    lines = prepared_lines.read(work, ids[0], 3)
    assert lines is not None and _same_lines(lines, store.batch_lines(ids[0]))
    assert not (work / "lines" / f"{ids[1]}.partial").exists()


def test_a_single_batch_is_left_to_the_store(planned) -> None:
    store, batches, work = planned
    prepared_lines.prepare(store, work, batches["batch_id"].head(1).to_list())
    assert not (work / "lines").exists()


@pytest.fixture
def emu() -> Iterator[Emulator]:
    started = Emulator(EmulatorConfig(**TEST_CONFIG)).start()
    yield started
    started.stop()


def test_a_prepared_file_is_uploaded_whole_even_when_the_sdk_sends_it_again(planned, emu) -> None:
    """The upload streams the prepared file; a retried upload (here after a 500) sends it
    from its start again, and the provider holds exactly the file's bytes."""
    store, batches, work = planned
    prepared_lines.prepare(store, work, batches["batch_id"].to_list())
    batch_id, n = next(iter(_counts(batches).items()))
    lines = prepared_lines.read(work, batch_id, n)
    assert isinstance(lines, JsonlFile)
    set_faults(emu, "500:POST /v1/files:1")
    client = openai_client(emu, max_retries=2)
    file_id = OpenAIBatchBackend(client).upload(batch_id, lines)
    rules = admin(emu, "GET", "/_emulator/faults")["rules"]
    assert [rule["count"] for rule in rules] == [0]  # the first try was refused
    assert client.files.content(file_id).content == lines.path.read_bytes()
    assert _same_lines(lines, store.batch_lines(batch_id))
