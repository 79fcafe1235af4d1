"""Anthropic Message Batches through the official SDK over real HTTP
(checklist items 1, 5, 9, 10, 12, 15, 17-20, 23-25)."""

from __future__ import annotations

import json
from datetime import timedelta

import anthropic
import httpx
import jsonschema
import pytest

from tests.emulator.conftest import (
    LABEL_SCHEMA,
    advance,
    anthropic_client,
    batch_requests,
    message_params,
)


def _results(client: anthropic.Anthropic, batch_id: str) -> dict[str, dict]:
    return {r.custom_id: r.result.to_dict() for r in client.messages.batches.results(batch_id)}


def test_lifecycle_counts_and_absolute_results_url(emu):
    client = anthropic_client(emu)
    batch = client.messages.batches.create(requests=batch_requests(4))
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.expires_at - batch.created_at == timedelta(hours=24)
    assert batch._request_id.startswith("req_")

    advance(emu, 2)  # two requests have run, but counts only say "processing"
    batch = client.messages.batches.retrieve(batch.id)
    assert len(emu.ledger.executions()) == 2
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored) == (4, 0, 0)
    with pytest.raises(anthropic.AnthropicError):
        list(client.messages.batches.results(batch.id))  # no results_url yet: client-side error

    advance(emu, 2 + 9)  # all done at +4, results written 10 s later
    assert client.messages.batches.retrieve(batch.id).processing_status == "in_progress"
    advance(emu, 1)
    batch = client.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended"
    assert batch.ended_at - batch.created_at == timedelta(seconds=14)
    assert batch.request_counts.succeeded == 4 and batch.request_counts.processing == 0
    assert batch.results_url == f"{emu.base_url}/v1/messages/batches/{batch.id}/results"

    results = _results(client, batch.id)
    assert sorted(results) == [f"req-{i:04d}" for i in range(4)]
    for result in results.values():
        assert result["type"] == "succeeded"
        message = result["message"]
        assert message["id"].startswith("msg_") and message["stop_reason"] == "end_turn"
        jsonschema.validate(json.loads(message["content"][0]["text"]), LABEL_SCHEMA)
        assert message["usage"]["service_tier"] == "batch"
    assert emu.ledger.count_by_custom_id() == dict.fromkeys(results, 1)


def test_results_jsonl_is_shuffled_without_blank_lines(make_emu):
    emu = make_emu(seed=7)
    client = anthropic_client(emu)
    batch = client.messages.batches.create(requests=batch_requests(12))
    advance(emu, 100)
    url = client.messages.batches.retrieve(batch.id).results_url
    raw = httpx.get(url, headers={"x-api-key": "x"}).text
    assert raw.endswith("}\n") and "\n\n" not in raw
    order = [json.loads(line)["custom_id"] for line in raw.splitlines()]
    assert sorted(order) == [f"req-{i:04d}" for i in range(12)] and order != sorted(order)


@pytest.mark.parametrize(
    ("custom_id", "fragment"),
    [
        ("x" * 65, "at most 64 characters"),
        ("has:colon", "should match pattern"),
        ("", "should match pattern"),
    ],
)
def test_bad_custom_id_rejects_the_whole_batch(emu, custom_id, fragment):
    client = anthropic_client(emu)
    requests = [*batch_requests(2), {"custom_id": custom_id, "params": message_params("hi")}]
    with pytest.raises(anthropic.BadRequestError, match=fragment) as err:
        client.messages.batches.create(requests=requests)
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert client.messages.batches.list().data == []


def test_duplicate_custom_id_and_request_count_limits(make_emu):
    emu = make_emu(anthropic_max_requests=3)
    client = anthropic_client(emu)
    with pytest.raises(anthropic.BadRequestError, match="Duplicate"):
        client.messages.batches.create(requests=[*batch_requests(2), batch_requests(1)[0]])
    with pytest.raises(anthropic.BadRequestError, match="at most 3"):
        client.messages.batches.create(requests=batch_requests(4))
    assert client.messages.batches.list().data == []


def test_oversize_body_is_413(make_emu):
    emu = make_emu(anthropic_max_body_bytes=2000)
    with pytest.raises(anthropic.APIStatusError) as err:
        anthropic_client(emu).messages.batches.create(requests=batch_requests(10))
    assert err.value.status_code == 413
    assert err.value.body["error"]["type"] == "request_too_large"


def test_errored_results_leave_the_rest_alone(make_emu):
    emu = make_emu(error_rate=0.3)
    client = anthropic_client(emu)
    requests = batch_requests(20)
    requests[0]["params"]["max_tokens"] = 0  # invalid params surface as an errored result
    batch = client.messages.batches.create(requests=requests)
    advance(emu, 100)
    batch = client.messages.batches.retrieve(batch.id)
    results = _results(client, batch.id)
    errored = {k: v for k, v in results.items() if v["type"] == "errored"}
    assert results["req-0000"]["error"]["error"]["type"] == "invalid_request_error"
    assert {v["error"]["error"]["type"] for v in errored.values()} == {
        "invalid_request_error",
        "api_error",
    }
    assert all(v["error"]["type"] == "error" for v in errored.values())
    assert batch.request_counts.errored == len(errored)
    assert batch.request_counts.succeeded == 20 - len(errored)
    assert set(emu.ledger.count_by_custom_id()) == set(results) - set(errored)


def test_expiry_keeps_partial_results(make_emu):
    emu = make_emu(batch_seconds_per_request=30_000)
    client = anthropic_client(emu)
    batch = client.messages.batches.create(requests=batch_requests(4))
    advance(emu, 86_400)
    batch = client.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended" and batch.ended_at == batch.expires_at
    counts = batch.request_counts
    assert (counts.succeeded, counts.expired) == (2, 2)
    types = {k: v["type"] for k, v in _results(client, batch.id).items()}
    assert types == {
        "req-0000": "succeeded",
        "req-0001": "succeeded",
        "req-0002": "expired",
        "req-0003": "expired",
    }


def test_cancel_then_delete(emu):
    client = anthropic_client(emu)
    batch = client.messages.batches.create(requests=batch_requests(6))
    advance(emu, 1.5)  # request 0 done, request 1 in flight
    batch = client.messages.batches.cancel(batch.id)
    assert batch.processing_status == "canceling" and batch.results_url is None
    assert batch.cancel_initiated_at - batch.created_at == timedelta(seconds=1.5)
    assert client.messages.batches.cancel(batch.id).processing_status == "canceling"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.delete(batch.id)  # not ended yet
    advance(emu, 30)
    batch = client.messages.batches.retrieve(batch.id)
    assert batch.processing_status == "ended"
    assert (batch.request_counts.succeeded, batch.request_counts.canceled) == (2, 4)
    types = _results(client, batch.id)
    assert [types[f"req-{i:04d}"]["type"] for i in range(6)] == ["succeeded"] * 2 + ["canceled"] * 4
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.cancel(batch.id)
    deleted = client.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_a_batch_that_ended_on_its_own_can_be_deleted(emu):
    client = anthropic_client(emu)
    batch = client.messages.batches.create(requests=batch_requests(2))
    kept = client.messages.batches.create(requests=batch_requests(1))
    advance(emu, 12)  # 2 requests (1 s each), then 10 s to end
    assert client.messages.batches.retrieve(batch.id).processing_status == "ended"
    deleted = client.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    for call in (client.messages.batches.retrieve, client.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError):
            call(batch.id)
    assert [b.id for b in client.messages.batches.list()] == [kept.id]


def test_archive_after_29_days(emu):
    client = anthropic_client(emu)
    batch = client.messages.batches.create(requests=batch_requests(1))
    advance(emu, 100)
    assert client.messages.batches.retrieve(batch.id).archived_at is None
    advance(emu, 29 * 86_400)
    batch = client.messages.batches.retrieve(batch.id)
    assert batch.archived_at - batch.created_at == timedelta(days=29)
    with pytest.raises(anthropic.NotFoundError):
        list(client.messages.batches.results(batch.id))


def test_list_is_newest_first_and_auto_paginates(emu):
    client = anthropic_client(emu)
    created = [client.messages.batches.create(requests=batch_requests(1)).id for _ in range(5)]
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == created[::-1][:2] and page.has_more
    assert page.first_id == created[-1] and page.last_id == created[-2]
    assert [b.id for b in client.messages.batches.list(limit=2)] == created[::-1]
    before = client.messages.batches.list(limit=2, before_id=created[0])
    assert [b.id for b in before.data] == [created[2], created[1]] and before.has_more
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.list(limit=1001)


def test_unknown_batch_is_404_in_anthropic_envelope(emu):
    client = anthropic_client(emu)
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.batches.retrieve("msgbatch_missing")
    body = err.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert body["request_id"] == err.value.response.headers["request-id"]


def test_structured_output_forced_tool_and_truncation(emu):
    client = anthropic_client(emu)
    requests = [
        {"custom_id": "json", "params": message_params("my card was stolen")},
        {"custom_id": "tool", "params": message_params("my card was stolen", structured="tool")},
        {"custom_id": "cut", "params": message_params("my card was stolen", max_tokens=3)},
        {
            "custom_id": "cut-tool",
            "params": message_params("my card was stolen", max_tokens=3, structured="tool"),
        },
    ]
    batch = client.messages.batches.create(requests=requests)
    advance(emu, 100)
    results = {k: v["message"] for k, v in _results(client, batch.id).items()}
    assert json.loads(results["json"]["content"][0]["text"])["label"] == "lost_or_stolen_card"
    tool_block = results["tool"]["content"][0]
    assert tool_block["type"] == "tool_use" and tool_block["name"] == "record_label"
    jsonschema.validate(tool_block["input"], LABEL_SCHEMA)
    assert results["tool"]["stop_reason"] == "tool_use"
    assert (
        results["cut"]["stop_reason"] == "max_tokens"
        and results["cut"]["usage"]["output_tokens"] == 3
    )
    assert results["cut-tool"]["stop_reason"] == "max_tokens"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(results["cut-tool"]["content"][0]["input"], LABEL_SCHEMA)


def test_prompt_cache_for_cache_control_blocks(make_emu):
    emu = make_emu(anthropic_cache_min_tokens=100)
    client = anthropic_client(emu)
    system = [
        {
            "type": "text",
            "text": "You label banking queries carefully. " * 40,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    requests = batch_requests(3)
    for item in requests:
        item["params"]["system"] = system
    batch = client.messages.batches.create(requests=requests)
    advance(emu, 100)
    usages = sorted(
        (v["message"]["usage"] for v in _results(client, batch.id).values()),
        key=lambda u: -u["cache_creation_input_tokens"],
    )
    first, *later = usages
    assert first["cache_creation_input_tokens"] > 100 and first["cache_read_input_tokens"] == 0
    for usage in later:
        assert usage["cache_read_input_tokens"] == first["cache_creation_input_tokens"]
        assert usage["cache_creation_input_tokens"] == 0
        assert usage["input_tokens"] < first["cache_creation_input_tokens"]  # cached part excluded
    assert (
        emu.ledger.total_usage()["cached_input_tokens"] == 2 * first["cache_creation_input_tokens"]
    )
