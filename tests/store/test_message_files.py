"""The ledger's messages live in files beside the state file, not in it.

A manifest keeps dedupe's file of messages (linked, not copied) and each stored request names
it; lines are built from it when a batch is sent. A finished run's file is cut down to the
messages of requests still without an answer, then removed. A lost file refuses to send, naming
the folder, and the next run asking the same requests stores them anew.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest

from lowtide.errors import LowtideError
from lowtide.store import Store, message_files
from tests.sql import query, scalar
from tests.store.runs import RUN


def _requests(ids: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "custom_id": ids,
            "request_key": [f"k-{i}" for i in ids],
            "job": ["j"] * len(ids),
            "model": ["m"] * len(ids),
            "est_input_tokens": [1] * len(ids),
            "template_id": ["t"] * len(ids),
        }
    )


def _manifest(store: Store, tmp_path: Path, run_id: str, ids: list[str]) -> str:
    """The manifest of one batch of `ids`, its messages from a file as dedupe writes it."""
    messages = tmp_path / f"{run_id}-to_send.parquet"
    pl.DataFrame({"custom_id": ids, "user": [f"message {i}" for i in ids]}).write_parquet(messages)
    batch_id = f"{run_id}-s0000-a1"
    batches = pl.DataFrame(
        {"batch_id": [batch_id], "shard": [0], "attempt": [1], "backend": ["openai"]}
    ).with_columns(n_requests=pl.lit(len(ids)), n_bytes=pl.lit(100))
    members = pl.DataFrame({"batch_id": [batch_id] * len(ids), "custom_id": ids})
    store.save_template("t", "H", "M", "T")
    store.write_manifest(run_id, _requests(ids), batches, members, messages=messages)
    messages.unlink()  # the run's work dir is removed when it finishes
    return batch_id


def _answer(store: Store, outcomes: dict[str, str]) -> None:
    con = duckdb.connect(str(store.path))
    try:
        for custom_id, outcome in outcomes.items():
            con.execute(
                "INSERT INTO results (custom_id, run_id, outcome, attempts, received_at) "
                "VALUES (?, 'r1', ?, 1, now())",
                [custom_id, outcome],
            )
    finally:
        con.close()


def _open(store: Store, run_id: str) -> None:
    store.open_run(run_id=run_id, **RUN)


def _kept(store: Store) -> dict[str, list[str]]:
    return {
        f.name: sorted(pl.read_parquet(f)["custom_id"].to_list())
        for f in sorted(store.messages_dir.iterdir())
    }


def test_messages_are_kept_beside_the_state_file_and_lines_built_from_them(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.duckdb")
    batch_id = _manifest(store, tmp_path, "r1", ["a", "b", "c"])
    assert list(store.batch_lines(batch_id)) == [f'H"{i}"M"message {i}"T' for i in "abc"]
    assert scalar(store, "SELECT count(user_message) FROM requests") == 0
    assert list(_kept(store).values()) == [["a", "b", "c"]]
    lines = store.request_lines(["b"])
    assert lines["line"].to_list() == ['H"b"M"message b"T']


def test_a_finished_runs_file_keeps_only_what_may_still_be_sent(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    _manifest(store, tmp_path, "r1", ["a", "b", "c", "d"])
    _answer(store, {"a": "ok", "b": "repaired", "c": "provider_error"})  # d: no result yet
    assert store.prune_messages() == 1
    assert list(_kept(store).values()) == [["c", "d"]]
    # what is left still builds the lines a retry or a later run sends
    assert store.request_lines(["c", "d"]).sort("custom_id")["line"].to_list() == [
        'H"c"M"message c"T',
        'H"d"M"message d"T',
    ]
    assert store.prune_messages() == 0  # nothing more to cut
    con = duckdb.connect(str(store.path))
    con.execute("UPDATE results SET outcome = 'ok' WHERE custom_id = 'c'")
    con.close()
    _answer(store, {"d": "ok"})
    assert store.prune_messages() == 1
    assert _kept(store) == {}


def test_an_unfinished_runs_file_is_left_alone(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    _open(store, "r1")
    _manifest(store, tmp_path, "r1", ["a", "b"])
    _answer(store, {"a": "ok", "b": "ok"})
    assert store.prune_messages() == 0  # its retry rounds may still read it
    assert list(_kept(store).values()) == [["a", "b"]]


def test_a_resumed_manifest_gets_a_file_of_its_own(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    _manifest(store, tmp_path, "r1", ["a", "b"])
    store.save_template("t", "H", "M", "T")
    # another run asks `b` again and one more: `b`'s stored row keeps naming the first file
    second = _manifest(store, tmp_path, "r2", ["b", "c"])
    files = query(store, "SELECT custom_id, message_file FROM requests ORDER BY 1")
    assert files["message_file"].n_unique() == 2
    assert files["message_file"][1] == files["message_file"][0]  # b: as first stored
    assert len(_kept(store)) == 2
    assert list(store.batch_lines(second)) == ['H"b"M"message b"T', 'H"c"M"message c"T']


def test_a_lost_file_refuses_to_send_and_the_next_run_stores_the_messages_anew(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.duckdb")
    first = _manifest(store, tmp_path, "r1", ["a", "b"])
    for f in store.messages_dir.iterdir():
        f.unlink()
    with pytest.raises(LowtideError, match=r"2 request\(s\) to send have no message") as e:
        store.batch_lines(first)
    assert str(store.messages_dir) in str(e.value)
    with pytest.raises(LowtideError, match="have no message"):
        store.request_lines(["a"])
    second = _manifest(store, tmp_path, "r2", ["a", "b"])
    assert list(store.batch_lines(second)) == ['H"a"M"message a"T', 'H"b"M"message b"T']
    assert list(store.batch_lines(first)) == list(store.batch_lines(second))


def test_lines_of_many_batches_read_each_file_a_slice_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lowtide.store import lines

    monkeypatch.setattr(lines, "_LINES_PER_PART", 2)
    store = Store(tmp_path / "state.duckdb")
    first = _manifest(store, tmp_path, "r1", ["e", "a", "c", "b", "d"])
    second = _manifest(store, tmp_path, "r2", ["c", "f", "g"])  # c: in r1's file
    # a request sent whole, as re-asks are: no file
    store.write_manifest(
        "r3",
        _requests(["h"]).drop("template_id").with_columns(line=pl.lit("whole line h")),
        pl.DataFrame(
            {"batch_id": ["r3-s0000-a1"], "shard": [0], "attempt": [1], "backend": ["openai"]}
        ).with_columns(n_requests=pl.lit(1), n_bytes=pl.lit(10)),
        pl.DataFrame({"batch_id": ["r3-s0000-a1"], "custom_id": ["h"]}),
    )
    batches = [first, second, "r3-s0000-a1"]
    parts: list[pl.DataFrame] = []
    store.each_batch_lines(batches, parts.append)
    together = pl.concat(parts).sort("batch_id", "custom_id")
    for batch_id in batches:
        lines = together.filter(pl.col("batch_id") == batch_id)["line"].to_list()
        assert lines == list(store.batch_lines(batch_id))
    assert together.height == 9

    # a file that lacks a request's message: refused, as one batch's lines are
    kept = next(f for f in store.messages_dir.iterdir() if f.name.startswith("r2."))
    pl.read_parquet(kept).filter(pl.col("custom_id") != "g").write_parquet(kept)
    with pytest.raises(LowtideError, match=r"1 request\(s\) to send have no message"):
        store.each_batch_lines(batches, lambda part: None)


def test_a_kept_file_does_not_change_when_its_run_writes_the_work_file_again(
    tmp_path: Path,
) -> None:
    from lowtide.slices import FileWriter

    work = tmp_path / "to_send.parquet"
    first = pl.DataFrame({"custom_id": ["a"], "user": ["first"]})
    first.write_parquet(work)
    name = message_files.keep(tmp_path / "kept", work, "r1")
    again = FileWriter(work)  # a resumed run's dedupe writes its file anew
    again.write(pl.DataFrame({"custom_id": ["b"], "user": ["second"]}))
    again.close()
    assert pl.read_parquet(tmp_path / "kept" / name).equals(first)
    assert pl.read_parquet(work)["user"].to_list() == ["second"]


def test_a_message_an_unfinished_run_asks_is_kept_though_answered(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    _manifest(store, tmp_path, "r1", ["a", "b"])
    # r2 found `a` unanswered and is about to send it: its stored row names r1's file
    _open(store, "r2")
    units = pl.DataFrame(
        {
            "unit_id": ["u1"],
            "source_id": ["s1"],
            "kind": ["row"],
            "chunk_index": [0],
            "n_chunks": [1],
            "unit_tokens": [3],
            "custom_id": ["a"],
            "cache_hit": [False],
        }
    )
    store.save_units("r2", units)
    _answer(store, {"a": "ok", "b": "ok"})  # then r1 got both answers and ended
    assert store.prune_messages() == 1
    assert list(_kept(store).values()) == [["a"]]
    assert store.request_lines(["a"])["line"].to_list() == ['H"a"M"message a"T']


def test_a_file_that_lacks_a_stored_message_is_mended_by_the_next_manifest(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.duckdb")
    _manifest(store, tmp_path, "r1", ["a", "b"])
    kept = next(store.messages_dir.iterdir())
    pl.read_parquet(kept).filter(pl.col("custom_id") == "a").write_parquet(kept)  # b is lost
    second = _manifest(store, tmp_path, "r2", ["b", "c"])
    assert list(store.batch_lines(second)) == ['H"b"M"message b"T', 'H"c"M"message c"T']


def test_lines_read_only_the_files_their_requests_name(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    first = _manifest(store, tmp_path, "r1", ["a"])
    (store.messages_dir / "other.1234.parquet").write_bytes(b"not parquet")  # another run's
    (store.messages_dir / "notes.txt").write_text("not lowtide's")
    assert list(store.batch_lines(first)) == ['H"a"M"message a"T']
    assert store.request_lines(["a"])["line"].to_list() == ['H"a"M"message a"T']
    store.prune_messages()  # the damaged file is cut like any other; the stranger is left be
    assert (store.messages_dir / "notes.txt").exists()
