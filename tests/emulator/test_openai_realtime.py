"""Realtime /v1/chat/completions through the SDK (items 24, 25 and the ledger)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from lowtide.emulator import model as emulated_model
from tests.emulator.conftest import LABEL_SCHEMA, TEXTS, admin, chat_body, openai_client


def test_structured_output_is_schema_valid_and_billed_as_realtime(emu):
    client = openai_client(emu)
    completion = client.chat.completions.create(**chat_body(TEXTS[0]))
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion._request_id.startswith("req_")
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    data = json.loads(choice.message.content)
    jsonschema.validate(data, LABEL_SCHEMA)
    assert data["label"] == "card_arrival"
    usage = completion.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    (entry,) = emu.ledger.executions()
    assert (
        entry["kind"] == "realtime" and entry["provider"] == "openai" and entry["custom_id"] is None
    )
    assert (
        entry["input_tokens"] == usage.prompt_tokens
        and entry["output_tokens"] == usage.completion_tokens
    )


def test_same_request_same_answer_and_longer_prompts_cost_more(emu):
    client = openai_client(emu)
    first = client.chat.completions.create(**chat_body(TEXTS[1]))
    second = client.chat.completions.create(**chat_body(TEXTS[1]))
    assert first.choices[0].message.content == second.choices[0].message.content
    longer = client.chat.completions.create(**chat_body(TEXTS[1] + " and more words" * 20))
    assert longer.usage.prompt_tokens > first.usage.prompt_tokens


def test_truncation_reports_length(emu):
    completion = openai_client(emu).chat.completions.create(**chat_body(TEXTS[2], max_tokens=4))
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.choices[0].message.content)


def test_malformed_rate_and_model_version_follow_the_admin_config(emu):
    client = openai_client(emu)

    def model_answer(text: str, **config: Any) -> str:
        """What the emulated model answers to `text` under `config` (the server's oracle)."""
        body = chat_body(text)
        return emulated_model.answer(
            body["messages"], schema=LABEL_SCHEMA, max_tokens=200, model=body["model"], **config
        ).text

    def ask(text: str) -> str:
        return client.chat.completions.create(**chat_body(text)).choices[0].message.content

    # a message whose label the version-2 model gets wrong (about 4% of messages are)
    drifted = next(
        text
        for text in (f"{TEXTS[3]} #{i}" for i in range(1000))
        if model_answer(text, model_version=1) != model_answer(text, model_version=2)
    )
    clean = ask(drifted)
    assert clean == model_answer(drifted)  # the default: version 1, nothing broken
    jsonschema.validate(json.loads(clean), LABEL_SCHEMA)

    admin(emu, "POST", "/_emulator/config", {"malformed_rate": 1.0})
    broken = ask(drifted)
    assert broken == model_answer(drifted, malformed_rate=1.0) != clean
    with pytest.raises(json.JSONDecodeError):
        json.loads(broken)

    admin(emu, "POST", "/_emulator/config", {"malformed_rate": 0.0, "model_version": 2})
    regressed = ask(drifted)
    assert regressed == model_answer(drifted, model_version=2)
    assert json.loads(regressed)["label"] != json.loads(clean)["label"]
    jsonschema.validate(json.loads(regressed), LABEL_SCHEMA)


def test_json_object_and_plain_text_modes(emu):
    client = openai_client(emu)
    body = chat_body("hello")
    body["response_format"] = {"type": "json_object"}
    assert isinstance(
        json.loads(client.chat.completions.create(**body).choices[0].message.content), dict
    )
    del body["response_format"]
    assert "hello" in client.chat.completions.create(**body).choices[0].message.content


@pytest.mark.parametrize(
    "patch",
    [
        {"messages": []},
        {"max_tokens": 0},
        {"model": ""},
        {"response_format": {"type": "json_schema"}},
    ],
)
def test_bad_requests_are_400_and_not_billed(emu, patch):
    client = openai_client(emu)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{**chat_body("hi"), **patch})
    assert err.value.body["type"] == "invalid_request_error"
    assert emu.ledger.executions() == []
