"""Account limits through the official SDKs over real HTTP (lowtide/emulator/limits.py):
OpenAI's enqueued-token pool decided on the simulated timeline, its batch-create rate, and
Anthropic's processing queue, each 429 with a retry hint in real time."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from lowtide.emulator import EmulatorConfig
from lowtide.emulator.limits import retry_headers, wait_until_fits
from tests.emulator.conftest import (
    TEXTS,
    admin,
    advance,
    anthropic_client,
    message_params,
    openai_client,
    upload_named_batch,
)


def _create(client: openai.OpenAI, file_id: str) -> Any:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _config(emu: Any, **fields: Any) -> None:
    admin(emu, "POST", "/_emulator/config", fields)


# --------------------------------------------------------------------------- enqueued tokens


@pytest.mark.parametrize("steps", [[100], [20, 80], [10, 10, 80], [5] * 20], ids=str)
def test_enqueued_limit_is_decided_at_each_validation_end(make_emu, steps):
    """X is created first but validates for 20 s; Y second, for 10 s. The pool holds one of
    them: Y, admitted at 10 and finalizing until 24, still holds it at X's validation end, so
    X is refused, however far each clock jump goes and although X comes first in every
    listing the emulator keeps."""
    emu = make_emu()
    client = openai_client(emu)
    x_file, x_ids, x_tokens = upload_named_batch(client, "x")
    y_file, y_ids, y_tokens = upload_named_batch(client, "y")
    limit = x_tokens + y_tokens - 1
    _config(emu, validating_s=20, enqueued_token_limit=limit)
    x = _create(client, x_file)
    _config(emu, validating_s=10)
    y = _create(client, y_file)
    for step in steps:
        advance(emu, step)

    y = client.batches.retrieve(y.id)
    assert (y.status, y.in_progress_at, y.completed_at) == (
        "completed",
        y.created_at + 10,
        y.created_at + 24,
    )
    x = client.batches.retrieve(x.id)
    assert (x.status, x.failed_at, x.in_progress_at) == ("failed", x.created_at + 20, None)
    [error] = x.errors.data
    assert (error.code, error.line) == ("token_limit_exceeded", None)
    assert error.message == (
        f"Enqueued token limit reached for gpt-4o-mini in organization emulator. Limit: {limit} "
        "enqueued tokens. Please try again once some in_progress batches have been completed."
    )
    assert (x.output_file_id, x.error_file_id, x.request_counts.total) == (None, None, 0)
    assert emu.ledger.count_by_custom_id() == dict.fromkeys(y_ids, 1)  # X ran and billed nothing
    assert not set(x_ids) & {e["custom_id"] for e in emu.ledger.errors()}


def test_tokens_are_held_until_the_terminal_status(make_emu):
    """Y is admitted at 10, finalizes from 14 and completes at 24. A batch validated at 23
    finds the pool full (finalizing still holds it); one validated at 24 finds it free."""
    emu = make_emu()
    client = openai_client(emu)
    y_file, _, y_tokens = upload_named_batch(client, "y")
    early_file, _, early_tokens = upload_named_batch(client, "early")
    late_file, _, late_tokens = upload_named_batch(client, "late")
    assert early_tokens == late_tokens
    _config(emu, enqueued_token_limit=y_tokens + late_tokens - 1)
    y = _create(client, y_file)
    advance(emu, 13)
    early = _create(client, early_file)  # validation ends at 23
    advance(emu, 1)
    late = _create(client, late_file)  # validation ends at 24, the moment Y completes
    advance(emu, 1000)
    assert client.batches.retrieve(y.id).completed_at == y.created_at + 24
    assert client.batches.retrieve(early.id).status == "failed"
    late = client.batches.retrieve(late.id)
    assert (late.status, late.in_progress_at) == ("completed", y.created_at + 24)


def test_a_batch_cancelled_while_validating_holds_no_tokens(make_emu):
    emu = make_emu()
    client = openai_client(emu)
    x_file, _, x_tokens = upload_named_batch(client, "x")
    y_file, _, y_tokens = upload_named_batch(client, "y")
    _config(emu, enqueued_token_limit=x_tokens + y_tokens - 1)
    x = _create(client, x_file)
    advance(emu, 5)
    assert client.batches.cancel(x.id).status == "cancelling"  # cancelled at 35, never admitted
    y = _create(client, y_file)
    advance(emu, 10)
    assert client.batches.retrieve(y.id).status == "in_progress"
    assert client.batches.retrieve(x.id).status == "cancelling"


# --------------------------------------------------------------------------- create rate


def test_creates_beyond_the_hourly_rate_get_429_until_a_slot_frees(make_emu):
    emu = make_emu(batch_creates_per_hour=2)
    client = openai_client(emu)
    file_id, _, _ = upload_named_batch(client, "a", n=1)
    _create(client, file_id)
    advance(emu, 100)
    _create(client, file_id)
    with pytest.raises(openai.RateLimitError) as err:
        _create(client, file_id)
    # The first create leaves the hour 3,500 simulated seconds from now; with the frozen
    # test clock that is also the hint's value.
    headers = err.value.response.headers
    assert (headers["retry-after-ms"], headers["retry-after"]) == ("3500000", "3500")
    body = err.value.body
    assert (body["type"], body["code"], body["param"]) == ("requests", "rate_limit_exceeded", None)
    assert "limit 2 batches per hour" in body["message"]
    assert len(client.batches.list().data) == 2  # the 429 created nothing
    advance(emu, 3499)
    with pytest.raises(openai.RateLimitError) as err:
        _create(client, file_id)
    assert err.value.response.headers["retry-after-ms"] == "1000"
    advance(emu, 1)
    assert _create(client, file_id).status == "validating"
    assert len(client.batches.list().data) == 3


@pytest.mark.parametrize(
    ("simulated_s", "time_scale", "millis", "seconds"),
    [
        (3500, 0, "3500000", "3500"),  # frozen clock: the simulated wait as it is
        (3600, 600, "6000", "6"),  # ten simulated minutes per real second
        (30, 60, "500", "1"),  # half a real second: retry-after is at least 1
        (0.1, 1, "100", "1"),  # no float noise (0.1 * 1000 is 100.00000000000001)
        (1, 3, "334", "1"),  # rounded up, never early
        (0, 1, "1", "1"),
    ],
)
def test_retry_hints_are_real_time(simulated_s, time_scale, millis, seconds):
    assert retry_headers(simulated_s, time_scale) == {
        "retry-after-ms": millis,
        "retry-after": seconds,
    }


@pytest.mark.parametrize(
    ("held", "need", "limit", "wait"),
    [
        ([(30.0, 3), (20.0, 2)], 5, 5, 20.0),  # both must go; the later release decides
        ([(30.0, 3), (20.0, 2)], 2, 5, 10.0),  # the earlier release is enough
        ([(30.0, 3)], 2, 5, 0.0),  # fits now
        ([(30.0, 3)], 6, 5, None),  # never fits
    ],
)
def test_wait_until_fits(held, need, limit, wait):
    assert wait_until_fits(held, 10.0, need, limit) == wait


# --------------------------------------------------------------------------- Anthropic queue


def _requests(prefix: str, n: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"{prefix}-{i}",
            "params": message_params(f"{TEXTS[i % len(TEXTS)]} {prefix}"),
        }
        for i in range(n)
    ]


def test_anthropic_queue_limit_refuses_creates_with_a_retry_hint(make_emu):
    emu = make_emu(anthropic_queue_limit=5)
    client = anthropic_client(emu)
    first = client.messages.batches.create(requests=_requests("a", 3))  # in_progress until 13
    advance(emu, 2)
    with pytest.raises(anthropic.RateLimitError) as err:
        client.messages.batches.create(requests=_requests("b", 3))
    headers = err.value.response.headers
    assert (headers["retry-after"], headers["retry-after-ms"]) == ("11", "11000")
    assert err.value.body["error"]["type"] == "rate_limit_error"
    assert "3 requests are waiting" in err.value.body["error"]["message"]
    assert err.value.response.headers["request-id"].startswith("req_")
    with pytest.raises(anthropic.RateLimitError) as err:
        client.messages.batches.create(requests=_requests("c", 6))  # over the whole queue
    assert err.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in err.value.response.headers
    assert (
        client.messages.batches.create(requests=_requests("d", 2)).processing_status
        == "in_progress"
    )

    advance(emu, 11)  # the first batch has ended: its 3 requests left the queue
    assert client.messages.batches.retrieve(first.id).processing_status == "ended"
    client.messages.batches.create(requests=_requests("e", 3))
    advance(emu, 1000)
    batches = list(client.messages.batches.list())
    assert len(batches) == 3  # a, d, e: the refused creates left nothing
    billed = emu.ledger.count_by_custom_id("anthropic")
    assert sorted(billed) == sorted(
        f"{p}-{i}" for p, n in (("a", 3), ("d", 2), ("e", 3)) for i in range(n)
    )
    assert emu.ledger.errors() == []


def test_a_canceling_batch_no_longer_counts_as_queued(make_emu):
    emu = make_emu(anthropic_queue_limit=3)
    client = anthropic_client(emu)
    first = client.messages.batches.create(requests=_requests("a", 3))
    with pytest.raises(anthropic.RateLimitError):
        client.messages.batches.create(requests=_requests("b", 1))
    client.messages.batches.cancel(first.id)
    assert (
        client.messages.batches.create(requests=_requests("b", 1)).processing_status
        == "in_progress"
    )


# --------------------------------------------------------------------------- configuration


def test_limits_are_settable_like_every_field(emu):
    config = EmulatorConfig.from_env(
        {
            "LOWTIDE_EMULATOR_BATCH_CREATES_PER_HOUR": "2000",
            "LOWTIDE_EMULATOR_ANTHROPIC_QUEUE_LIMIT": "200000",
            "LOWTIDE_EMULATOR_FILE_STORAGE_LIMIT_BYTES": "none",
        }
    )
    assert (config.batch_creates_per_hour, config.anthropic_queue_limit) == (2000, 200_000)
    assert config.file_storage_limit_bytes is None
    patched = admin(
        emu,
        "POST",
        "/_emulator/config",
        {"batch_creates_per_hour": "5", "anthropic_queue_limit": 7, "file_storage_limit_bytes": 9},
    )
    assert (patched["batch_creates_per_hour"], patched["anthropic_queue_limit"]) == (5, 7)
    assert patched["file_storage_limit_bytes"] == 9
