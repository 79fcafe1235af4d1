"""The emulator's state folder: a restarted emulator knows what the last one knew, like a
provider, and resumes its clock there (lowtide/emulator/persist.py)."""

from __future__ import annotations

import logging
import shutil
import urllib.error
from pathlib import Path

import anthropic
import openai
import pytest

from lowtide.emulator import Emulator
from lowtide.emulator.persist import BLOBS_DIR, SNAPSHOT_NAME
from tests.emulator.conftest import (
    MakeEmulator,
    admin,
    advance,
    anthropic_client,
    batch_requests,
    openai_client,
    parse_jsonl,
    upload_batch,
)


def _create(client: openai.OpenAI, file_id: str) -> str:
    return client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"lowtide_batch": "b1"},
    ).id


def test_a_restarted_emulator_resumes_files_batches_clock_and_ledger(
    make_emu: MakeEmulator, tmp_path: Path
) -> None:
    folder = str(tmp_path / "emu")
    first = make_emu(state_dir=folder)
    client = openai_client(first)
    file_id, ids = upload_batch(client, n=6)
    batch_id = _create(client, file_id)
    advance(first, 10 + 3)  # validated, then 3 of the 6 requests ran (1 s each)
    assert client.batches.retrieve(batch_id).request_counts.completed == 3
    clock = admin(first, "GET", "/_emulator/clock")["now"]
    first.stop()

    second = make_emu(state_dir=folder)
    client = openai_client(second)
    assert admin(second, "GET", "/_emulator/clock")["now"] == clock  # frozen clock: exactly there
    assert client.files.retrieve(file_id).bytes == len(client.files.content(file_id).content)
    batch = client.batches.retrieve(batch_id)
    assert (batch.status, batch.metadata) == ("in_progress", {"lowtide_batch": "b1"})
    assert [b.id for b in client.batches.list()] == [batch_id]
    advance(second, 3 + 10)
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.output_file_id is not None
    lines = parse_jsonl(client.files.content(batch.output_file_id).text)
    assert sorted(line["custom_id"] for line in lines) == ids
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert second.ledger.count_by_custom_id() == dict.fromkeys(ids, 1)  # 3 before, 3 after


def test_work_lost_with_the_process_is_done_again_once(
    make_emu: MakeEmulator, tmp_path: Path
) -> None:
    """A process killed after its last snapshot loses what it did since; the restarted one
    resumes at the snapshot's time and executes each lost request once, at the same moment."""
    folder, killed = tmp_path / "emu", tmp_path / "as-killed"
    first = make_emu(state_dir=str(folder))
    client = openai_client(first)
    file_id, ids = upload_batch(client, n=6)
    batch_id = _create(client, file_id)
    advance(first, 10)  # in_progress: a status change, so a snapshot
    shutil.copytree(folder, killed, ignore=shutil.ignore_patterns("lock"))  # the disk at a kill
    advance(first, 4)  # 4 requests run and are billed after that moment
    assert len(first.ledger.count_by_custom_id()) == 4

    second = make_emu(state_dir=str(killed))
    client = openai_client(second)
    assert second.ledger.count_by_custom_id() == {}
    advance(second, 6 + 10)
    batch = client.batches.retrieve(batch_id)
    assert batch.status == "completed"
    assert batch.request_counts is not None and batch.request_counts.completed == 6
    assert second.ledger.count_by_custom_id() == dict.fromkeys(ids, 1)


def test_message_batches_and_attempt_counters_survive(
    make_emu: MakeEmulator, tmp_path: Path
) -> None:
    folder = str(tmp_path / "emu")
    first = make_emu(state_dir=folder, error_rate=0.5)
    client = anthropic_client(first)
    done = client.messages.batches.create(requests=batch_requests(8))
    advance(first, 8 + 10)
    running = client.messages.batches.create(requests=batch_requests(4))
    advance(first, 1)
    first.stop()

    second = make_emu(state_dir=folder, error_rate=0.5)
    client = anthropic_client(second)
    assert client.messages.batches.retrieve(done.id).processing_status == "ended"
    assert len(list(client.messages.batches.results(done.id))) == 8
    advance(second, 4 + 10)
    ended = client.messages.batches.retrieve(running.id)
    assert ended.processing_status == "ended"
    assert {r.custom_id for r in client.messages.batches.results(running.id)} == {
        f"req-{i:04d}" for i in range(4)
    }
    # req-0000 ran in the first batch (attempt 0) and in the second before the stop (attempt 1):
    # the counter was kept, so its next run is attempt 2
    assert second.state.next_attempt("anthropic", "req-0000") == 2
    billed = len(second.ledger.executions()) + len(second.ledger.errors())
    assert billed == 12  # every request executed once, across both processes


def test_deleted_files_and_message_batches_stay_gone(
    make_emu: MakeEmulator, tmp_path: Path
) -> None:
    folder = tmp_path / "emu"
    first = make_emu(state_dir=str(folder))
    client = openai_client(first)
    kept, _ = upload_batch(client, n=1)
    gone, _ = upload_batch(client, n=2)
    client.files.delete(gone)
    messages = anthropic_client(first)
    batch = messages.messages.batches.create(requests=batch_requests(1))
    advance(first, 1 + 10)
    messages.messages.batches.delete(batch.id)
    first.stop()
    blobs = sorted(p.name for p in (folder / BLOBS_DIR).iterdir())
    assert blobs == [f"content.{kept}"]  # nothing left of what was deleted

    second = make_emu(state_dir=str(folder))
    assert [f.id for f in openai_client(second).files.list()] == [kept]
    with pytest.raises(openai.NotFoundError):
        openai_client(second).files.retrieve(gone)
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client(second).messages.batches.retrieve(batch.id)


def test_a_write_cut_short_leaves_the_previous_snapshot(
    make_emu: MakeEmulator, tmp_path: Path
) -> None:
    folder = tmp_path / "emu"
    first = make_emu(state_dir=str(folder))
    file_id, _ = upload_batch(openai_client(first), n=2)
    first.stop()
    # what a SIGKILL in the middle of the next writes leaves behind
    (folder / (SNAPSHOT_NAME + ".tmp")).write_bytes(b"\x80\x05half a pick")
    (folder / BLOBS_DIR / "content.file-new.tmp").write_bytes(b"half")

    second = make_emu(state_dir=str(folder))
    assert [f.id for f in openai_client(second).files.list()] == [file_id]
    assert [p.name for p in (folder / BLOBS_DIR).iterdir()] == [f"content.{file_id}"]


def test_an_unreadable_snapshot_is_set_aside(
    make_emu: MakeEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "emu"
    folder.mkdir()
    (folder / SNAPSHOT_NAME).write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING, logger="lowtide.emulator"):
        emu = make_emu(state_dir=str(folder))
    assert "Cannot read the emulator state" in caplog.text
    assert openai_client(emu).files.list().data == []
    assert (folder / (SNAPSHOT_NAME + ".unreadable")).read_bytes() == b"not a pickle"


def test_a_folder_in_use_leaves_the_second_emulator_in_memory(
    make_emu: MakeEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = str(tmp_path / "emu")
    first = make_emu(state_dir=folder)
    file_id, _ = upload_batch(openai_client(first), n=1)
    with caplog.at_level(logging.WARNING, logger="lowtide.emulator"):
        second = make_emu(state_dir=folder)
    assert "in use by another emulator" in caplog.text
    assert openai_client(second).files.list().data == []  # it loaded nothing
    upload_batch(openai_client(second), n=1)  # and writes nothing
    first.stop()
    second.stop()
    third = make_emu(state_dir=folder)
    assert [f.id for f in openai_client(third).files.list()] == [file_id]


def test_stop_then_start_keeps_persisting(make_emu: MakeEmulator, tmp_path: Path) -> None:
    folder = str(tmp_path / "emu")
    emu = make_emu(state_dir=folder)
    emu.stop()
    emu.start()
    file_id, _ = upload_batch(openai_client(emu), n=1)
    emu.stop()
    with Emulator(emu.config) as again:
        assert [f.id for f in openai_client(again).files.list()] == [file_id]


def test_state_dir_cannot_be_patched(make_emu: MakeEmulator, tmp_path: Path) -> None:
    emu = make_emu(state_dir=str(tmp_path / "emu"))
    with pytest.raises(urllib.error.HTTPError, match="400"):
        admin(emu, "POST", "/_emulator/config", {"state_dir": str(tmp_path / "other")})


def test_a_folder_that_cannot_be_created_leaves_the_emulator_in_memory(
    make_emu: MakeEmulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with caplog.at_level(logging.WARNING, logger="lowtide.emulator"):
        emu = make_emu(state_dir=str(not_a_folder / "emu"))
    assert "keeps its state in memory only" in caplog.text
    upload_batch(openai_client(emu), n=1)
    assert len(openai_client(emu).files.list().data) == 1
