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


def _create(client: openai.OpenAI, file_id: str, **kw):
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", **kw
    )


def _upload_lines(client: openai.OpenAI, lines: list) -> str:
    payload = b"".join(
        (ln if isinstance(ln, bytes) else json.dumps(ln).encode()) + b"\n" for ln in lines
    )
    return client.files.create(file=("in.jsonl", payload), purpose="batch").id


def test_file_validation_fails_asynchronously_with_line_numbers(emu):
    client = openai_client(emu)
    good = batch_line("ok-1", chat_body("hi"))
    lines = [
        good,  # line 1
        b'{"custom_id": "broken", ',  # 2: not JSON
        {"custom_id": "no-body", "method": "POST", "url": "/v1/chat/completions"},  # 3
        batch_line("get", chat_body("hi"), method="GET"),  # 4
        batch_line("wrong-url", chat_body("hi"), url="/v1/embeddings"),  # 5
        batch_line("other-model", chat_body("hi", model="gpt-4o")),  # 6
        batch_line("ok-1", chat_body("again")),  # 7: duplicate custom_id
    ]
    batch = _create(client, _upload_lines(client, lines))
    assert batch.status == "validating"  # accepted synchronously
    advance(emu, 10)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "failed" and batch.failed_at == batch.created_at + 10
    by_line = {e.line: e.code for e in batch.errors.data}
    assert by_line == {
        2: "invalid_json_line",
        3: "missing_required_parameter",
        4: "invalid_method",
        5: "invalid_url",
        6: "mismatched_model",
        7: "duplicate_custom_id",
    }
    assert all(e.message for e in batch.errors.data)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (0, 0, 0)
    assert batch.output_file_id is None and batch.error_file_id is None
    advance(emu, 1000)
    assert emu.ledger.executions() == []  # nothing ran, nothing billed


@pytest.mark.parametrize(
    ("overrides", "code", "line"),
    [
        ({"max_batch_lines": 3}, "too_many_requests", 4),
        ({"max_batch_file_bytes": 500}, "file_too_large", None),
        ({"enqueued_token_limit": 20}, "token_limit_exceeded", None),
    ],
)
def test_batch_level_limits_fail_the_batch(make_emu, overrides, code, line):
    emu = make_emu(**overrides)
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=4)
    batch = _create(client, file_id)
    advance(emu, 10)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "failed"
    assert [(e.code, e.line) for e in batch.errors.data] == [(code, line)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"completion_window": "1h"}, "completion_window"),
        ({"endpoint": "/v1/unknown"}, "endpoint"),
        ({"input_file_id": "file-missing"}, "input_file_id"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 60}}, "output_expires_after"),
    ],
)
def test_create_time_checks_are_synchronous_400s(emu, kwargs, param):
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=1)
    args = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **kwargs,
    }
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(**args)
    assert err.value.param == param
    assert client.batches.list().data == []


def test_batch_input_needs_purpose_batch(emu):
    client = openai_client(emu)
    other = client.files.create(
        file=("x.jsonl", jsonl([batch_line("a", chat_body("hi"))])), purpose="user_data"
    )
    with pytest.raises(openai.BadRequestError, match="purpose"):
        _create(client, other.id)


def test_oversize_upload_is_rejected(make_emu):
    emu = make_emu(max_upload_bytes=1000)
    client = openai_client(emu)
    with pytest.raises(openai.BadRequestError, match="too large"):
        client.files.create(file=("big.jsonl", b"x" * 2000), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"x"), purpose="nonsense")  # type: ignore[arg-type]


def _run_to_end(emu, client, batch_id, step=100, limit=50):
    for _ in range(limit):
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        advance(emu, step)
    raise AssertionError(f"batch {batch_id} did not finish")


def test_results_are_shuffled_by_seed(make_emu):
    orders = []
    for seed, shuffle in ((1, True), (1, True), (2, True), (1, False)):
        emu = make_emu(seed=seed, shuffle_results=shuffle)
        client = openai_client(emu)
        file_id, ids = upload_batch(client, n=12)
        batch = _run_to_end(emu, client, _create(client, file_id).id)
        out = parse_jsonl(client.files.content(batch.output_file_id).text)
        orders.append([line["custom_id"] for line in out])
    assert orders[0] == orders[1]  # same seed, same order
    assert orders[0] != ids and orders[2] != orders[0]
    assert sorted(orders[0]) == ids
    assert orders[3] == ids  # shuffle_results=False keeps input order


def test_per_request_errors_go_to_error_file(make_emu):
    emu = make_emu(error_rate=0.5)
    client = openai_client(emu)
    file_id, ids = upload_batch(client, n=20)
    batch = _run_to_end(emu, client, _create(client, file_id).id)
    assert batch.status == "completed"
    out = parse_jsonl(client.files.content(batch.output_file_id).text)
    errors = parse_jsonl(client.files.content(batch.error_file_id).text)
    assert 0 < len(errors) < 20 and len(out) + len(errors) == 20
    assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(errors)
    assert sorted(line["custom_id"] for line in out + errors) == ids
    for line in errors:
        assert line["error"] is None  # the request ran; the endpoint answered non-2xx
        assert line["response"]["status_code"] == 500
        err = line["response"]["body"]["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    # Errored requests ran but are not billed; successes are billed once.
    billed = emu.ledger.count_by_custom_id()
    assert set(billed) == {line["custom_id"] for line in out}
    assert {e["custom_id"] for e in emu.ledger.errors()} == {line["custom_id"] for line in errors}


def test_retried_request_draws_its_error_afresh(make_emu):
    emu = make_emu(error_rate=0.5)
    client = openai_client(emu)
    file_id, ids = upload_batch(client, n=20)
    first = _run_to_end(emu, client, _create(client, file_id).id)
    failed = {
        line["custom_id"] for line in parse_jsonl(client.files.content(first.error_file_id).text)
    }
    retry = _run_to_end(emu, client, _create(client, file_id).id)
    still = {
        line["custom_id"] for line in parse_jsonl(client.files.content(retry.error_file_id).text)
    }
    assert still != failed  # attempt number is part of the draw


def test_invalid_request_body_is_a_400_line_not_a_validation_failure(emu):
    client = openai_client(emu)
    bad = chat_body("hi")
    bad["max_tokens"] = 0
    file_id = _upload_lines(client, [batch_line("good", chat_body("hi")), batch_line("bad", bad)])
    batch = _run_to_end(emu, client, _create(client, file_id).id)
    assert batch.status == "completed" and batch.request_counts.failed == 1
    (line,) = parse_jsonl(client.files.content(batch.error_file_id).text)
    assert line["custom_id"] == "bad" and line["response"]["status_code"] == 400
    assert line["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_expiry_keeps_partial_results(make_emu):
    # 4 requests of 30,000 s each: two finish inside the 24 h window, two never run.
    emu = make_emu(batch_seconds_per_request=30_000)
    client = openai_client(emu)
    file_id, ids = upload_batch(client, n=4)
    batch = _create(client, file_id)
    advance(emu, 86_400 + 1)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "expired" and batch.expired_at == batch.expires_at
    assert batch.request_counts.completed == 2 and batch.request_counts.failed == 2
    out = parse_jsonl(client.files.content(batch.output_file_id).text)
    errors = parse_jsonl(client.files.content(batch.error_file_id).text)
    assert sorted(line["custom_id"] for line in out) == ids[:2]
    assert sorted(line["custom_id"] for line in errors) == ids[2:]
    for line in errors:
        assert line["response"] is None and line["error"]["code"] == "batch_expired"
    assert emu.ledger.count_by_custom_id() == dict.fromkeys(ids[:2], 1)


def test_cancel_in_progress_keeps_finished_work(emu):
    client = openai_client(emu)
    file_id, ids = upload_batch(client, n=6)
    batch = _create(client, file_id)
    advance(emu, 11.5)  # in progress since +10; request 0 done, request 1 running
    batch = client.batches.cancel(batch.id)
    assert batch.status == "cancelling" and batch.cancelling_at == batch.created_at + 11
    advance(emu, 10)
    assert client.batches.retrieve(batch.id).status == "cancelling"  # drain takes 30 s
    advance(emu, 20)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at == batch.created_at + 41
    out = parse_jsonl(client.files.content(batch.output_file_id).text)
    errors = parse_jsonl(client.files.content(batch.error_file_id).text)
    assert sorted(line["custom_id"] for line in out) == ids[:2]  # the in-flight one finished
    assert sorted(line["custom_id"] for line in errors) == ids[2:]
    assert all(line["error"]["code"] == "batch_cancelled" for line in errors)
    assert batch.request_counts.completed == 2 and batch.request_counts.failed == 4
    assert emu.ledger.count_by_custom_id() == dict.fromkeys(ids[:2], 1)
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(_run_to_end(emu, client, _create(client, file_id).id).id)


def test_cancel_while_validating_runs_nothing(emu):
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=3)
    batch = client.batches.cancel(_create(client, file_id).id)
    assert batch.status == "cancelling"
    assert client.batches.cancel(batch.id).status == "cancelling"  # idempotent
    batch = _run_to_end(emu, client, batch.id)
    assert batch.status == "cancelled" and batch.output_file_id is None
    assert emu.ledger.executions() == []


def test_empty_files_can_be_kept(make_emu):
    emu = make_emu(omit_empty_files=False)
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=2)
    batch = _run_to_end(emu, client, _create(client, file_id).id)
    assert batch.error_file_id is not None
    assert client.files.content(batch.error_file_id).content == b""


def test_auto_pagination_lists_every_batch_and_file(emu):
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=1)
    created = [_create(client, file_id).id for _ in range(7)]
    page = client.batches.list(limit=3)
    assert page.has_more and len(page.data) == 3 and page.data[0].id == created[-1]
    assert [b.id for b in client.batches.list(limit=3)] == created[::-1]  # newest first, all pages
    for _ in range(4):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="user_data")
    everything = [f.id for f in client.files.list(limit=2)]
    assert len(everything) == 5 and len(set(everything)) == 5
    oldest_first = [f.id for f in client.files.list(limit=2, order="asc")]
    assert oldest_first == everything[::-1]
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)


def test_file_retention_and_delete(emu):
    client = openai_client(emu)
    short = client.files.create(
        file=("a.jsonl", b"{}\n"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    kept = client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
    deleted = client.files.delete(kept.id)
    assert deleted.deleted and deleted.id == kept.id
    with pytest.raises(openai.NotFoundError):
        client.files.content(kept.id)
    advance(emu, 3601)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(short.id)
    assert client.files.list().data == []


def test_output_files_follow_output_expires_after(emu):
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=1)
    batch = _create(client, file_id, output_expires_after={"anchor": "created_at", "seconds": 7200})
    batch = _run_to_end(emu, client, batch.id)
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200
    advance(emu, 7200)
    with pytest.raises(openai.NotFoundError):
        client.files.content(batch.output_file_id)


def test_slow_finalizing_fault(make_emu):
    emu = make_emu()
    from tests.emulator.conftest import set_faults

    set_faults(emu, "slow_finalizing:600")
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=1)
    batch = _create(client, file_id)
    advance(emu, 11)
    assert client.batches.retrieve(batch.id).status == "finalizing"
    advance(emu, 500)
    assert client.batches.retrieve(batch.id).status == "finalizing"
    advance(emu, 200)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.completed_at == batch.finalizing_at + 610


def test_batch_usage_counts_cached_prompt_tokens(make_emu):
    emu = make_emu(openai_cache_min_tokens=50)
    client = openai_client(emu)
    system = "You label banking queries. " * 40
    lines = []
    for i in range(3):
        body = chat_body(f"card {i}")
        body["messages"][0]["content"] = system
        lines.append(batch_line(f"c{i}", body))
    batch = _run_to_end(emu, client, _create(client, _upload_lines(client, lines)).id)
    out = parse_jsonl(client.files.content(batch.output_file_id).text)
    cached = [
        line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in out
    ]
    assert sorted(cached)[0] == 0 and sorted(cached)[1] > 0  # first request writes, later ones read
    assert batch.usage.input_tokens_details.cached_tokens == sum(cached)
    assert emu.ledger.total_usage()["cached_input_tokens"] == sum(cached)
