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
from lowtide.errors import LowtideError
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


def _in_files(lines, work) -> bool:
    """Whether prepared lines wait in a file of the work directory (not in memory)."""
    return isinstance(lines, JsonlFile) and work / "lines" in lines.path.parents


def _read_all(work, counts: dict[str, int], order: list[str]) -> dict:
    return {b: prepared_lines.read(work, b, counts[b]) for b in order}


def test_a_streamed_pass_holds_each_batch_in_memory_till_its_send(planned) -> None:
    """Asked in sending order, every batch's payload is built from one pass; from a messages
    file (as every night's are) in memory, with no file written."""
    store, batches, work = planned
    from_file = store.messages_dir.is_dir() and any(store.messages_dir.iterdir())
    counts = _counts(batches)
    with prepared_lines.streamed(store, work, list(counts)):
        for batch_id, n in counts.items():
            lines = prepared_lines.read(work, batch_id, n)
            assert lines is not None and len(lines) == n
            assert _same_lines(lines, store.batch_lines(batch_id))
            if from_file:
                assert not _in_files(lines, work)
            prepared_lines.discard(work, batch_id)
    if from_file:
        assert not (work / "lines").exists()


@pytest.mark.parametrize("held_most", [0, 1 << 20])
def test_batches_met_before_their_send_wait_for_it(planned, monkeypatch, held_most) -> None:
    """Asked last batch first, the pass meets the others whole before it: they wait in memory
    while that holds little, in their files past it, each with exactly its lines."""
    store, batches, work = planned
    monkeypatch.setattr(prepared_lines, "_HELD_MOST", held_most)
    counts = _counts(batches)
    order = list(reversed(counts))
    with prepared_lines.streamed(store, work, list(counts)):
        got = _read_all(work, counts, order)
        for batch_id in order:
            assert got[batch_id] is not None, f"{batch_id}: no prepared lines"
            assert _same_lines(got[batch_id], store.batch_lines(batch_id))
    in_files = [b for b in order if _in_files(got[b], work)]
    if held_most:
        assert not in_files and not (work / "lines").exists()
    else:
        assert in_files == order[1:]  # all but the one asked for first
        assert not [p for p in (work / "lines").iterdir() if p.name.endswith(".partial")]


def test_a_pass_closed_early_leaves_no_unfinished_file_and_the_store_builds_the_rest(
    planned, monkeypatch
) -> None:
    """A run that stops sending (a batch refused, Ctrl-C) closes its pass: a batch met in part
    leaves no file behind, and its send builds the lines from the store."""
    from lowtide.store import lines as store_lines

    store, batches, work = planned
    monkeypatch.setattr(prepared_lines, "_HELD_MOST", 0)
    monkeypatch.setattr(store_lines, "_LINES_PER_PART", 2)  # batches of 3 span parts
    counts = _counts(batches)
    first = next(iter(counts))
    with prepared_lines.streamed(store, work, list(counts)):
        assert prepared_lines.read(work, first, counts[first]) is not None
        assert any(p.name.endswith(".partial") for p in (work / "lines").iterdir())
    assert not [p for p in (work / "lines").iterdir() if p.name.endswith(".partial")]
    for batch_id in list(counts)[1:]:
        lines = prepared_lines.read(work, batch_id, counts[batch_id])
        assert lines is None or _same_lines(lines, store.batch_lines(batch_id))
    assert any(prepared_lines.read(work, b, n) is None for b, n in counts.items())


def test_a_missing_message_is_refused_before_any_line_is_handed_over(tmp_path) -> None:
    store, job = Store(tmp_path / "state.duckdb"), load_job(SAMPLE_JOB)
    path = tmp_path / "to_send.parquet"
    _requests(USERS).with_columns(pl.lit(False).alias("urgent")).write_parquet(path)
    batches = _manifest(
        job, store, sized_requests(job, path).drop("urgent"), messages=path, max_requests=3
    )
    kept = next(store.messages_dir.iterdir())
    pl.read_parquet(kept).slice(1).write_parquet(kept)  # the file lacks its first message
    counts = _counts(batches)
    work = tmp_path / "work"
    with (
        pytest.raises(LowtideError, match=r"1 request\(s\) to send have no message"),
        prepared_lines.streamed(store, work, list(counts)),
    ):
        prepared_lines.read(work, *next(iter(counts.items())))


def test_a_payload_held_in_memory_is_uploaded_whole_even_when_sent_again(planned, emu) -> None:
    """The payload built for a send is streamed from memory, from its start again on a retry,
    and a send asked again (a retried task) gets the same payload."""
    store, batches, work = planned
    counts = _counts(batches)
    batch_id, n = next(iter(counts.items()))
    set_faults(emu, "500:POST /v1/files:1")
    client = openai_client(emu, max_retries=2)
    with prepared_lines.streamed(store, work, list(counts)):
        lines = prepared_lines.read(work, batch_id, n)
        assert lines is not None and not _in_files(lines, work)
        file_id = OpenAIBatchBackend(client).upload(batch_id, lines)
        assert prepared_lines.read(work, batch_id, n) is lines
        payload = lines.jsonl()
    rules = admin(emu, "GET", "/_emulator/faults")["rules"]
    assert [rule["count"] for rule in rules] == [0]  # the first try was refused
    assert client.files.content(file_id).content == payload
    assert sorted(payload.decode().splitlines()) == sorted(store.batch_lines(batch_id))
