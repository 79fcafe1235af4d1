"""OpenAI Files through the official SDK: expiry, delete, listing as the SDK paginates it, and
the organization's storage limit (checklist item 26)."""

from __future__ import annotations

import openai
import pytest

from tests.emulator.conftest import advance, openai_client

HOUR = {"anchor": "created_at", "seconds": 3600}


def test_expired_files_vanish_from_every_route(emu):
    client = openai_client(emu)
    kept = [
        client.files.create(file=(f"k{i}.jsonl", b"{}\n"), purpose="user_data") for i in range(3)
    ]
    short = client.files.create(file=("s.jsonl", b"{}\n"), purpose="batch", expires_after=HOUR)
    assert short.expires_at == short.created_at + 3600
    advance(emu, 3599)
    assert client.files.retrieve(short.id).id == short.id  # alive until its expires_at
    advance(emu, 1)
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(short.id)
    assert client.files.list(purpose="batch").data == []
    # One file per page, oldest first: auto-pagination follows `after` to the end.
    assert [f.id for f in client.files.list(limit=1, order="asc")] == [f.id for f in kept]
    assert [f.id for f in client.files.list(limit=2)] == [f.id for f in kept[::-1]]

    deleted = client.files.delete(kept[1].id)
    assert (deleted.id, deleted.object, deleted.deleted) == (kept[1].id, "file", True)
    assert [f.id for f in client.files.list(purpose="user_data", order="asc")] == [
        kept[0].id,
        kept[2].id,
    ]
    with pytest.raises(openai.NotFoundError):
        client.files.delete(kept[1].id)  # deleted once is gone


def test_uploads_past_the_storage_limit_are_refused(make_emu):
    emu = make_emu(file_storage_limit_bytes=100)
    client = openai_client(emu)
    big = client.files.create(file=("a.jsonl", b"a" * 60), purpose="user_data")
    client.files.create(file=("b.jsonl", b"b" * 30), purpose="batch", expires_after=HOUR)
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("c.jsonl", b"c" * 11), purpose="user_data")
    assert err.value.status_code == 400 and err.value.code is None
    assert "File storage limit reached" in err.value.message
    assert "90 bytes" in err.value.message and "limit of 100 bytes" in err.value.message
    assert len(client.files.list().data) == 2  # nothing stored
    client.files.create(file=("c.jsonl", b"c" * 10), purpose="user_data")  # exactly the limit

    client.files.delete(big.id)  # a deleted file frees its bytes
    client.files.create(file=("d.jsonl", b"d" * 60), purpose="user_data")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("e.jsonl", b"e" * 30), purpose="user_data")
    advance(emu, 3600)  # so does an expired one
    client.files.create(file=("e.jsonl", b"e" * 30), purpose="user_data")
