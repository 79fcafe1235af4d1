"""Realtime /v1/messages through the SDK (items 24, 25 and the ledger)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.emulator.conftest import LABEL_SCHEMA, TEXTS, anthropic_client, message_params


def test_output_config_json_is_schema_valid_and_billed_as_realtime(emu):
    client = anthropic_client(emu)
    message = client.messages.create(**message_params(TEXTS[2]))
    assert message.id.startswith("msg_") and message.stop_reason == "end_turn"
    data = json.loads(message.content[0].text)
    jsonschema.validate(data, LABEL_SCHEMA)
    assert data["label"] == "exchange_rate"
    assert message.usage.service_tier == "standard"
    (entry,) = emu.ledger.executions()
    assert (entry["provider"], entry["kind"], entry["batch_id"]) == ("anthropic", "realtime", None)
    assert entry["output_tokens"] == message.usage.output_tokens


def test_forced_tool_returns_tool_use(emu):
    message = anthropic_client(emu).messages.create(**message_params(TEXTS[3], structured="tool"))
    (block,) = message.content
    assert (
        block.type == "tool_use" and block.name == "record_label" and block.id.startswith("toolu_")
    )
    jsonschema.validate(block.input, LABEL_SCHEMA)
    assert message.stop_reason == "tool_use"


def test_plain_text_and_max_tokens(emu):
    client = anthropic_client(emu)
    plain = client.messages.create(**message_params("tell me about refunds", structured="none"))
    assert "refunds" in plain.content[0].text
    cut = client.messages.create(
        **message_params("tell me about refunds", structured="none", max_tokens=2)
    )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


@pytest.mark.parametrize(
    "patch",
    [
        {"max_tokens": 0},
        {"messages": []},
        {"tool_choice": {"type": "tool", "name": "missing"}},
        {
            "tools": [{"name": "t", "input_schema": LABEL_SCHEMA}],
            "tool_choice": {"type": "tool", "name": "t"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        },
    ],
)
def test_invalid_requests_are_400_and_not_billed(emu, patch):
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic_client(emu).messages.create(**{**message_params("hi"), **patch})
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert emu.ledger.executions() == []
