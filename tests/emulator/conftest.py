"""Emulator fixtures: a real server on a loopback port, driven through the real SDKs.

The default test clock is frozen (time_scale=0) so a test decides exactly when provider time
passes, with `advance(emu, seconds)`; that makes status transitions exact and fast.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator import model as emodel

# Simulated timings chosen so tests can land between transitions with round numbers.
TEST_CONFIG: dict[str, Any] = {
    "time_scale": 0.0,
    "validating_s": 10.0,
    "batch_seconds_per_request": 1.0,
    "finalizing_s": 10.0,
    "cancel_drain_s": 30.0,
    "error_rate": 0.0,
    "retry_after_s": 0.01,
}

MakeEmulator = Callable[..., Emulator]


@pytest.fixture
def make_emu() -> Iterator[MakeEmulator]:
    """Start emulators with TEST_CONFIG plus overrides; all are stopped after the test."""
    started: list[Emulator] = []

    def make(**overrides: Any) -> Emulator:
        emu = Emulator(EmulatorConfig(**{**TEST_CONFIG, **overrides})).start()
        started.append(emu)
        return emu

    yield make
    for emu in started:
        emu.stop()


@pytest.fixture
def emu(make_emu: MakeEmulator) -> Emulator:
    return make_emu()


def openai_client(emu: Emulator, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=emu.openai_base_url, api_key="x", max_retries=max_retries)


def anthropic_client(emu: Emulator, max_retries: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=emu.anthropic_base_url, api_key="x", max_retries=max_retries
    )


def admin(emu: Emulator, method: str, path: str, payload: Any = None) -> Any:
    """Call an /_emulator admin route over plain HTTP, as a test in another process would."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(
        emu.base_url + path, data=data, method=method, headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def advance(emu: Emulator, seconds: float) -> float:
    """Push the emulator's clock forward; returns the new simulated time."""
    return admin(emu, "POST", f"/_emulator/clock/advance?seconds={seconds}")["now"]


def set_faults(emu: Emulator, spec: str) -> list[dict[str, Any]]:
    return admin(emu, "POST", "/_emulator/faults", {"spec": spec})["rules"]


LABELS = ["card_arrival", "lost_or_stolen_card", "exchange_rate", "refund_not_showing_up"]
LABEL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": LABELS},
        "summary": {"type": "string", "maxLength": 40},
        "urgent": {"type": "boolean"},
    },
    "required": ["label", "summary", "urgent"],
    "additionalProperties": False,
}
TEXTS = [
    "My card has still not arrived, when will it come?",
    "Someone stole my card yesterday",
    "What exchange rate do you use for dollars?",
    "My refund is not showing up in the app",
]


def chat_body(
    text: str, *, max_tokens: int = 200, model: str = "gpt-4o-mini", **extra: Any
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "Classify the banking query."},
            {"role": "user", "content": text},
        ],
        "max_tokens": max_tokens,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "label", "strict": True, "schema": LABEL_SCHEMA},
        },
        **extra,
    }


def batch_line(
    custom_id: str, body: dict[str, Any], url: str = "/v1/chat/completions", method: str = "POST"
) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def jsonl(items: list[Any]) -> bytes:
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


def upload_batch(client: openai.OpenAI, n: int = 4, **body_extra: Any) -> tuple[str, list[str]]:
    """Upload an n-request chat batch file; returns (file id, custom ids in file order)."""
    ids = [f"req-{i:04d}" for i in range(n)]
    lines = [
        batch_line(cid, chat_body(TEXTS[i % len(TEXTS)] + f" #{i}", **body_extra))
        for i, cid in enumerate(ids)
    ]
    uploaded = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    return uploaded.id, ids


def upload_named_batch(
    client: openai.OpenAI, prefix: str, n: int = 4
) -> tuple[str, list[str], int]:
    """An n-request chat batch file whose custom_ids start with `prefix` (so batches of one
    test never share an id); returns (file id, custom ids, the prompt tokens the emulator
    counts for it: what it holds in the enqueued-token pool)."""
    bodies = {f"{prefix}-{i}": chat_body(f"{TEXTS[i % len(TEXTS)]} ({prefix})") for i in range(n)}
    lines = [batch_line(cid, body) for cid, body in bodies.items()]
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    tokens = sum(emodel.prompt_token_count(body["messages"]) for body in bodies.values())
    return uploaded.id, list(bodies), tokens


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def message_params(
    text: str,
    *,
    max_tokens: int = 200,
    model: str = "claude-sonnet-4-5",
    structured: str = "output_config",
    **extra: Any,
) -> dict[str, Any]:
    """Anthropic Messages params; `structured` is "output_config", "tool" or "none"."""
    params: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "system": "Classify the banking query.",
        "messages": [{"role": "user", "content": text}],
    }
    if structured == "output_config":
        params["output_config"] = {"format": {"type": "json_schema", "schema": LABEL_SCHEMA}}
    elif structured == "tool":
        params["tools"] = [{"name": "record_label", "input_schema": LABEL_SCHEMA, "strict": True}]
        params["tool_choice"] = {"type": "tool", "name": "record_label"}
    return {**params, **extra}


def batch_requests(n: int, **kw: Any) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"req-{i:04d}",
            "params": message_params(TEXTS[i % len(TEXTS)] + f" #{i}", **kw),
        }
        for i in range(n)
    ]
