"""Table tests for the rules every HTTP backend shares (`lowtide.backends.wire`), and checks
that the backends which read chat completions agree with them."""

from __future__ import annotations

from email.utils import parsedate_to_datetime
from typing import Any

import httpx2
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletion

from lowtide.backends import anthropic_batch, openai_batch, realtime
from lowtide.backends.base import RESULT_SCHEMA, TransientBackendError
from lowtide.backends.vllm_pool.endpoint import answered_row
from lowtide.backends.wire import (
    EMULATOR_FINGERPRINT,
    completion_row,
    is_transient_status,
    retry_after_s,
)

# -- transient statuses ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "transient"),
    [
        (200, False),
        (400, False),
        (401, False),
        (403, False),
        (404, False),
        (413, False),
        (422, False),
        (408, True),  # request timeout
        (409, True),  # conflict: a concurrent request held the resource
        (429, True),  # rate limited
        (500, True),
        (502, True),
        (503, True),
        (504, True),
        (529, True),  # Anthropic: overloaded
    ],
)
def test_is_transient_status(status, transient):
    assert is_transient_status(status) is transient


@pytest.mark.parametrize("status", [408, 409, 429, 500, 503, 529])
def test_the_sdk_translations_follow_the_rule(status):
    request = httpx2.Request("POST", "https://api.example.test/v1/chat/completions")
    response = httpx2.Response(status, request=request)
    assert isinstance(
        openai_batch.translate(openai.APIStatusError("x", response=response, body=None), "op"),
        TransientBackendError,
    )
    assert anthropic_batch.is_transient_status is is_transient_status


# -- Retry-After -----------------------------------------------------------------------------------

NOW = parsedate_to_datetime("Wed, 21 Oct 2026 07:28:00 GMT").timestamp()


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": "0.5"}, 0.5),
        # milliseconds win when both are given
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),
        # an unreadable one is skipped for the other
        ({"retry-after-ms": "soon", "retry-after": "3"}, 3.0),
        ({"retry-after-ms": "inf", "retry-after": "3"}, 3.0),
        # an HTTP date counts from now; one in the past means at once
        ({"retry-after": "Wed, 21 Oct 2026 07:28:30 GMT"}, 30.0),
        ({"retry-after": "Wed, 21 Oct 2026 07:27:00 GMT"}, 0.0),
        # never negative
        ({"retry-after": "-4"}, 0.0),
        ({"retry-after-ms": "-100"}, 0.0),
        # no usable hint
        ({"retry-after": "tomorrow"}, None),
        ({"retry-after": "nan"}, None),
        ({"retry-after": ""}, None),
        ({"content-type": "application/json"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_retry_after_s(headers, expected):
    assert retry_after_s(headers, now=NOW) == expected


@pytest.mark.parametrize(
    ("name", "value", "expected"), [("Retry-After", "2", 2.0), ("Retry-After-Ms", "40", 0.04)]
)
def test_retry_after_s_reads_http_headers_in_any_case(name, value, expected):
    assert retry_after_s(httpx2.Headers({name: value})) == expected


def test_realtime_reads_the_hint_from_the_error_response():
    request = httpx2.Request("POST", "https://api.example.test/v1/chat/completions")
    response = httpx2.Response(429, headers={"retry-after-ms": "1200"}, request=request)
    exc = openai.RateLimitError("slow down", response=response, body=None)
    assert realtime._retry_after(exc) == 1.2
    assert realtime._retry_after(ValueError("no response")) is None


# -- chat.completion → result row ----------------------------------------------------------------


def completion(
    content: str | None = '{"label": "lost_card"}',
    finish_reason: str = "stop",
    refusal: str | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": "chatcmpl-7",
        "object": "chat.completion",
        "created": 1_760_000_000,
        "model": "emulated-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 9,
    "total_tokens": 129,
    "prompt_tokens_details": {"cached_tokens": 64},
}
NO_DETAILS = {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129}
NULL_DETAILS = {**NO_DETAILS, "prompt_tokens_details": None}
NULL_CACHED = {**NO_DETAILS, "prompt_tokens_details": {"cached_tokens": None}}

# (completion, expected row after custom_id): every shape a server sends for a 200
ANSWERS = [
    (
        completion(usage=USAGE),
        ("answered", '{"label": "lost_card"}', "stop", None, 120, 64, 9, False),
    ),
    (
        completion(content='{"label": "lost', finish_reason="length", usage=USAGE),
        ("answered", '{"label": "lost', "length", None, 120, 64, 9, False),
    ),
    (
        completion(content=None, refusal="I can't help with that.", usage=USAGE),
        ("answered", None, "stop", "refusal: I can't help with that.", 120, 64, 9, False),
    ),
    # cached tokens not reported (vLLM without --enable-prompt-tokens-details): unknown
    (
        completion(usage=NO_DETAILS),
        ("answered", '{"label": "lost_card"}', "stop", None, 120, None, 9, False),
    ),
    (
        completion(usage=NULL_DETAILS),
        ("answered", '{"label": "lost_card"}', "stop", None, 120, None, 9, False),
    ),
    (
        completion(usage=NULL_CACHED),
        ("answered", '{"label": "lost_card"}', "stop", None, 120, None, 9, False),
    ),
    # no usage at all
    (
        completion(usage=None),
        ("answered", '{"label": "lost_card"}', "stop", None, None, None, None, False),
    ),
    # lowtide's emulator signs its answers: recorded as the emulator's, whoever asked
    (
        {**completion(usage=USAGE), "system_fingerprint": EMULATOR_FINGERPRINT},
        ("answered", '{"label": "lost_card"}', "stop", None, 120, 64, 9, True),
    ),
    (
        {**completion(usage=USAGE), "system_fingerprint": "fp_44709d6fcb"},
        ("answered", '{"label": "lost_card"}', "stop", None, 120, 64, 9, False),
    ),
]


@pytest.mark.parametrize(("body", "expected"), ANSWERS)
def test_completion_row(body, expected):
    row = completion_row("req-1", body)
    assert row == ("req-1", *expected)
    assert len(row) == len(RESULT_SCHEMA)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"choices": []}, ("answered", None, None, None, None, None, None, False)),
        ({}, ("answered", None, None, None, None, None, None, False)),
        (
            {"choices": [{"finish_reason": "stop"}]},
            ("answered", None, "stop", None, None, None, None, False),
        ),
        (
            {"choices": ["oops"], "usage": "none"},
            ("answered", None, None, None, None, None, None, False),
        ),
        (
            {
                "choices": [{"message": {"content": "hi", "refusal": ""}}],
                "usage": {"prompt_tokens": 3},
            },
            ("answered", "hi", None, None, 3, None, None, False),
        ),
    ],
)
def test_completion_row_reads_what_is_there_and_never_raises(body, expected):
    assert completion_row(None, body) == (None, *expected)


@pytest.mark.parametrize(("body", "expected"), ANSWERS)
def test_every_reader_of_a_completion_agrees(body, expected):
    """The pool (raw bytes), the realtime path (SDK object) and a batch output file
    (vectorised) read the same completion into the same row."""
    want = dict(zip(RESULT_SCHEMA, ("req-1", *expected), strict=True))
    raw = orjson.dumps(body)
    assert dict(zip(RESULT_SCHEMA, answered_row("req-1", raw), strict=True)) == want
    assert realtime._completion_row("req-1", ChatCompletion.model_validate(body)) == want
    line = {
        "id": "b-1",
        "custom_id": "req-1",
        "response": {"status_code": 200, "body": body},
        "error": None,
    }
    (from_file,) = openai_batch.parse_result_lines(orjson.dumps(line) + b"\n").to_dicts()
    assert from_file == want


@pytest.mark.parametrize(
    "content", [b"not json", b"[]", b'"text"', b"{}", b'{"choices": []}', b'{"choices": ["x"]}']
)
def test_the_pool_treats_a_200_without_a_first_choice_as_unreadable(content):
    assert answered_row("req-1", content) is None
