"""Every OpenAI route's JSON checked against the official OpenAPI description.

The spec (openai/openai-openapi, copied to ../shared/reference/openai-openapi.yaml) leaves many
optional fields non-nullable although the live API sends them as null (`output_file_id`,
`completed_at`, ... while a batch runs). The SDK types them Optional, so we relax the spec the
same way: a property that is not `required` may also be null. Everything else is checked as
written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import yaml

from tests.emulator.conftest import (
    advance,
    batch_line,
    chat_body,
    jsonl,
    openai_client,
    set_faults,
    upload_batch,
)

SPEC_PATH = (
    Path(__file__).resolve().parents[2].parent / "shared" / "reference" / "openai-openapi.yaml"
)


def _allow_null_when_optional(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _allow_null_when_optional(item)
        return
    if not isinstance(node, dict):
        return
    for value in node.values():
        _allow_null_when_optional(value)
    props = node.get("properties")
    if isinstance(props, dict):
        required = set(node.get("required") or [])
        for key, sub in list(props.items()):
            if key not in required:
                props[key] = {"anyOf": [sub, {"type": "null"}]}


@pytest.fixture(scope="session")
def openai_components() -> dict[str, Any]:
    if not SPEC_PATH.is_file():
        pytest.skip(
            f"OpenAI OpenAPI description not found at {SPEC_PATH} (it lives in ../shared/reference)"
        )
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(SPEC_PATH, encoding="utf-8") as fh:
        spec = yaml.load(fh, Loader=loader)
    components = spec["components"]
    _allow_null_when_optional(components["schemas"])
    return components


@pytest.fixture
def check(openai_components):
    def validate(schema_name: str, instance: Any) -> None:
        assert schema_name in openai_components["schemas"], schema_name
        schema = {"$ref": f"#/components/schemas/{schema_name}", "components": openai_components}
        jsonschema.Draft202012Validator(schema).validate(instance)

    return validate


def test_the_checker_catches_mistakes(check):
    with pytest.raises(jsonschema.ValidationError):
        check(
            "Batch",
            {
                "id": "b",
                "object": "batch",
                "endpoint": "/v1/chat/completions",
                "input_file_id": "f",
                "completion_window": "24h",
                "status": "sleeping",
                "created_at": 1,
            },
        )
    with pytest.raises(jsonschema.ValidationError):
        check("OpenAIFile", {"id": "f", "object": "file", "bytes": "12"})


def test_file_routes(emu, check):
    client = openai_client(emu)
    created = client.files.with_raw_response.create(
        file=("a.jsonl", jsonl([batch_line("a", chat_body("hi"))])), purpose="batch"
    )
    file_json = created.http_response.json()
    check("OpenAIFile", file_json)
    check(
        "OpenAIFile", client.files.with_raw_response.retrieve(file_json["id"]).http_response.json()
    )
    check("ListFilesResponse", client.files.with_raw_response.list().http_response.json())
    check(
        "DeleteFileResponse",
        client.files.with_raw_response.delete(file_json["id"]).http_response.json(),
    )
    missing = httpx.get(
        emu.openai_base_url + "/files/file-gone", headers={"authorization": "Bearer x"}
    )
    assert missing.status_code == 404
    check("ErrorResponse", missing.json())


def _raw_batch(client: openai.OpenAI, batch_id: str) -> dict[str, Any]:
    return client.batches.with_raw_response.retrieve(batch_id).http_response.json()


def test_batch_routes_in_every_state(make_emu, check):
    emu = make_emu(batch_seconds_per_request=30_000, error_rate=0.3)
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=4)
    create = lambda: client.batches.with_raw_response.create(  # noqa: E731
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"k": "v"},
    ).http_response.json()
    expiring, cancelled = create(), create()
    check("Batch", expiring)
    assert expiring["status"] == "validating"
    advance(emu, 10)
    check("Batch", client.batches.with_raw_response.cancel(cancelled["id"]).http_response.json())
    assert _raw_batch(client, expiring["id"])["status"] == "in_progress"
    check("Batch", _raw_batch(client, expiring["id"]))
    advance(emu, 90_000)
    states = {}
    for batch_id in (expiring["id"], cancelled["id"]):
        raw = _raw_batch(client, batch_id)
        check("Batch", raw)
        states[raw["status"]] = raw
    assert set(states) == {"expired", "cancelled"}
    assert states["expired"]["usage"]["input_tokens"] > 0

    bad = client.files.create(file=("bad.jsonl", b"not json\n"), purpose="batch")
    failed = client.batches.create(
        input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    advance(emu, 10)
    raw_failed = _raw_batch(client, failed.id)
    assert raw_failed["status"] == "failed"
    check("Batch", raw_failed)
    check(
        "ListBatchesResponse", client.batches.with_raw_response.list(limit=2).http_response.json()
    )


def test_completed_batch_and_its_output_lines(make_emu, check):
    emu = make_emu(error_rate=0.3)
    client = openai_client(emu)
    file_id, _ = upload_batch(client, n=10)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    advance(emu, 15)
    finalizing = _raw_batch(client, batch.id)
    assert finalizing["status"] == "in_progress"
    advance(emu, 5)
    finalizing = _raw_batch(client, batch.id)
    assert finalizing["status"] == "finalizing"
    check("Batch", finalizing)
    advance(emu, 10)
    done = _raw_batch(client, batch.id)
    assert done["status"] == "completed"
    check("Batch", done)
    import json

    for line in client.files.content(done["output_file_id"]).text.splitlines():
        check("CreateChatCompletionResponse", json.loads(line)["response"]["body"])
    for line in client.files.content(done["error_file_id"]).text.splitlines():
        check("ErrorResponse", json.loads(line)["response"]["body"])
    check(
        "OpenAIFile",
        client.files.with_raw_response.retrieve(done["output_file_id"]).http_response.json(),
    )


def test_chat_completion_and_error_envelopes(emu, check):
    client = openai_client(emu)
    raw = client.chat.completions.with_raw_response.create(**chat_body("my card is lost"))
    check("CreateChatCompletionResponse", raw.http_response.json())
    truncated = client.chat.completions.with_raw_response.create(
        **chat_body("my card is lost", max_tokens=2)
    )
    check("CreateChatCompletionResponse", truncated.http_response.json())
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(**{**chat_body("hi"), "messages": []})
    check("ErrorResponse", bad.value.response.json())
    set_faults(emu, "429:GET /v1/batches:1")
    with pytest.raises(openai.RateLimitError) as limited:
        client.batches.list()
    check("ErrorResponse", limited.value.response.json())
    unauthorized = httpx.get(emu.openai_base_url + "/files")
    check("ErrorResponse", unauthorized.json())
