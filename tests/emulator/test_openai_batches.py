"""OpenAI Files + Batches through the official SDK over real HTTP (checklist items 4-7, 10-16, 24)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.emulator.conftest import (
    LABEL_SCHEMA,
    advance,
    batch_line,
    chat_body,
    jsonl,
    openai_client,
    parse_jsonl,
    upload_batch,
)


def test_happy_path_status_machine_with_timestamps(emu):
    client = openai_client(emu)
    file_id, ids = upload_batch(client, n=4)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "t"},
    )
    t0 = batch.created_at
    assert batch.id.startswith("batch_") and batch.status == "validating"
    assert batch.expires_at == t0 + 86400
    assert batch.request_counts.total == 0 and batch.output_file_id is None
    assert batch.metadata == {"job": "t"}

    advance(emu, 10)  # validation (10 s) ends: in_progress, nothing finished yet
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "in_progress" and batch.in_progress_at == t0 + 10
    assert batch.request_counts.total == 4 and batch.request_counts.completed == 0
    assert batch.model == "gpt-4o-mini"

    advance(emu, 2)  # two of four requests (1 s each) have run: counts rise during the run
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "in_progress" and batch.request_counts.completed == 2
    assert emu.ledger.count_by_custom_id() == {ids[0]: 1, ids[1]: 1}

    advance(emu, 2)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "finalizing" and batch.finalizing_at == t0 + 14
    assert batch.output_file_id is None  # files appear only when finalization ends

    advance(emu, 10)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.completed_at == t0 + 24
    assert batch.request_counts.completed == 4 and batch.request_counts.failed == 0
    assert batch.error_file_id is None  # empty error file omitted

    out = parse_jsonl(client.files.content(batch.output_file_id).text)
    assert sorted(line["custom_id"] for line in out) == ids
    for line in out:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        assert line["response"]["request_id"].startswith("req_")
        body = line["response"]["body"]
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), LABEL_SCHEMA)
    usage_in = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in out)
    usage_out = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in out)
    assert batch.usage.input_tokens == usage_in and batch.usage.output_tokens == usage_out
    assert batch.usage.total_tokens == usage_in + usage_out
    assert emu.ledger.count_by_custom_id() == dict.fromkeys(ids, 1)

    output_file = client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output"
    assert output_file.id in {f.id for f in client.files.list(purpose="batch_output")}


def test_unknown_ids_are_404_in_openai_envelope(emu):
    client = openai_client(emu)
    with pytest.raises(openai.NotFoundError) as err:
        client.batches.retrieve("batch_nope")
    assert err.value.body["type"] == "invalid_request_error"
    assert err.value.request_id.startswith("req_")
    with pytest.raises(openai.NotFoundError):
        client.files.content("file-nope")


def test_each_request_runs_once_however_often_it_is_polled(emu):
    client = openai_client(emu)
    file_id, ids = upload_batch(client, n=3)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for _ in range(6):
        advance(emu, 5)
        client.batches.retrieve(batch.id)
        client.batches.list()
    assert client.batches.retrieve(batch.id).status == "completed"
    assert emu.ledger.count_by_custom_id() == dict.fromkeys(ids, 1)


def test_upload_accepts_bytes_path_and_expires_after(emu, tmp_path):
    client = openai_client(emu)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([batch_line("a", chat_body("hi"))]))
    by_path = client.files.create(
        file=path, purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert by_path.filename == "in.jsonl" and by_path.expires_at == by_path.created_at + 3600
    default = client.files.create(file=path.read_bytes(), purpose="batch")
    assert default.expires_at == default.created_at + 30 * 86400
    assert client.files.content(by_path.id).content == path.read_bytes()
