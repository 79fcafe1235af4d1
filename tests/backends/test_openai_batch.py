from __future__ import annotations

import pytest

from lowtide.backends import make_backend
from lowtide.backends.base import BatchStatus, RequestStatus, TerminalBackendError
from lowtide.backends.openai_batch import (
    NO_RESPONSE,
    for_base_url,
    map_status,
    parse_result_lines,
)
from lowtide.backends.wire import EMULATOR_FINGERPRINT
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.errors import CredentialsError
from tests.key_guard import RequireKey


@pytest.mark.parametrize(
    "provider,ours,terminal",
    [
        ("validating", BatchStatus.VALIDATING, False),
        ("in_progress", BatchStatus.IN_PROGRESS, False),
        ("finalizing", BatchStatus.FINALIZING, False),
        ("completed", BatchStatus.COMPLETED, True),
        ("failed", BatchStatus.FAILED, True),
        ("expired", BatchStatus.EXPIRED, True),
        ("cancelling", BatchStatus.CANCELLING, False),
        ("cancelled", BatchStatus.CANCELLED, True),
    ],
)
def test_status_table(provider: str, ours: BatchStatus, terminal: bool) -> None:
    assert map_status(provider) is ours
    assert ours.terminal is terminal


def test_unknown_status_is_terminal_error() -> None:
    with pytest.raises(TerminalBackendError, match="unknown OpenAI batch status 'paused'"):
        map_status("paused")


def test_result_lines_of_every_shape() -> None:
    content = b"\n".join(
        [
            b'{"id":"r1","custom_id":"a","response":{"status_code":200,"request_id":"q","body":{"choices":[{"index":0,"message":{"role":"assistant","content":"{}","refusal":null},"finish_reason":"length"}],"usage":{"prompt_tokens":20,"completion_tokens":5,"total_tokens":25,"prompt_tokens_details":{"cached_tokens":8}}}},"error":null}',
            b'{"id":"r2","custom_id":"b","response":{"status_code":429,"request_id":"q","body":{"error":{"message":"slow down","type":"rate_limit","param":null,"code":"rate_limit_exceeded"}}},"error":null}',
            b'{"id":"r3","custom_id":"c","response":null,"error":{"code":"batch_cancelled","message":"cancelled"}}',
            b'{"id":"r4","custom_id":"d","response":null,"error":{"code":"batch_expired","message":"too late"}}',
        ]
    )
    out = {r["custom_id"]: r for r in parse_result_lines(content).iter_rows(named=True)}
    assert out["a"]["status"] == "answered" and out["a"]["finish_reason"] == "length"
    assert (out["a"]["input_tokens"], out["a"]["cached_tokens"], out["a"]["output_tokens"]) == (
        20,
        8,
        5,
    )
    assert (
        out["b"]["status"] == "provider_error"
        and out["b"]["error"] == "HTTP 429 rate_limit_exceeded: slow down"
    )
    assert out["c"]["status"] == "cancelled" and out["d"]["status"] == "expired"
    assert parse_result_lines(b"").height == 0


def test_result_lines_say_refusals_errors_and_who_answered() -> None:
    answered = (
        '{"custom_id":"%s","response":{"status_code":200,"body":{"system_fingerprint":%s,'
        '"choices":[{"message":{"content":%s,"refusal":%s},"finish_reason":"stop"}],'
        '"usage":{"prompt_tokens":3,"completion_tokens":1}}},"error":null}'
    )
    content = "\n".join(
        [
            answered % ("emu", f'"{EMULATOR_FINGERPRINT}"', '"{}"', "null"),
            answered % ("real", '"fp_other"', '"{}"', "null"),
            answered % ("refused", "null", "null", '"not this"'),
            # a body error with a type and no code; a line with neither a response nor an error
            '{"custom_id":"typed","response":{"status_code":500,"body":{"error":'
            '{"message":"boom","type":"server_error"}}},"error":null}',
            '{"custom_id":"bare","response":null,"error":null}',
            '{"custom_id":"blank_error","response":null,"error":{"code":null,"message":null}}',
        ]
    ).encode()
    out = {r["custom_id"]: r for r in parse_result_lines(content).iter_rows(named=True)}
    assert [out[k]["emulated"] for k in ("emu", "real", "refused", "typed")] == [
        True,
        False,
        False,
        False,
    ]
    assert out["emu"]["raw_text"] == "{}" and out["emu"]["error"] is None
    assert out["emu"]["cached_tokens"] is None and out["emu"]["output_tokens"] == 1
    assert out["refused"]["status"] == RequestStatus.ANSWERED
    assert out["refused"]["raw_text"] is None and out["refused"]["error"] == "refusal: not this"
    assert out["typed"]["status"] == RequestStatus.PROVIDER_ERROR
    assert out["typed"]["error"] == "HTTP 500 server_error: boom"
    assert out["typed"]["raw_text"] is None and out["typed"]["finish_reason"] is None
    assert out["bare"]["status"] == RequestStatus.PROVIDER_ERROR
    assert out["bare"]["error"] == NO_RESPONSE  # not "HTTP ? : "
    assert out["blank_error"]["error"] == "error: "


def test_missing_key_says_where_it_looked() -> None:
    with pytest.raises(CredentialsError, match=r"set OPENAI_API_KEY \(looked in: environment\)"):
        make_backend("openai")


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_key_is_a_credentials_error_without_the_key(status: int) -> None:
    """Not a terminal refusal of the batch (the run stays resumable: tasks/submit.py); the key
    the provider echoed back is taken out of the message."""
    sent = f"sk-test-{status}-not-the-one"
    emu = Emulator(EmulatorConfig(time_scale=600.0))
    emu.app = RequireKey(emu.app, "sk-the-right-one", status=status, echo=True)
    with emu:
        backend = for_base_url(emu.openai_base_url, api_key=sent)
        refused = rf"openai refused the API key \(HTTP {status}"
        with pytest.raises(CredentialsError, match=refused) as info:
            backend.upload("b1", ['{"custom_id": "a"}'])
    assert info.value.operation == "upload"
    assert sent not in str(info.value) and "Incorrect API key provided: <key>" in str(info.value)


def test_unknown_backend_lists_known() -> None:
    with pytest.raises(
        TerminalBackendError,
        match="Unknown backend 'vllm2'; known: emulator, openai, anthropic, vllm",
    ):
        make_backend("vllm2")
