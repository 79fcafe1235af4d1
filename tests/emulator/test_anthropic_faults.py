"""Auth, headers and injected faults on Anthropic routes (checklist items 2, 3, 21, 22)."""

from __future__ import annotations

import anthropic
import httpx
import httpx2  # the SDKs' own HTTP stack (see provider-apis.md §8)
import pytest

from tests.emulator.conftest import advance, anthropic_client, batch_requests, set_faults


@pytest.mark.parametrize(
    "headers",
    [
        {"x-api-key": "k", "anthropic-version": "2023-06-01"},
        {"authorization": "Bearer k", "anthropic-version": "2026-10-21"},
        {
            "x-api-key": "k",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "message-batches-2024-09-24",
            "anthropic-workspace-id": "wrkspc_1",
            "x-stainless-lang": "python",
        },
    ],
)
def test_both_auth_styles_and_any_version(emu, headers):
    response = httpx.get(emu.anthropic_base_url + "/v1/messages/batches", headers=headers)
    assert response.status_code == 200 and response.json()["data"] == []
    assert response.headers["request-id"].startswith("req_")
    assert "x-request-id" not in response.headers


def test_missing_auth_is_401_in_anthropic_envelope(emu):
    response = httpx.get(
        emu.anthropic_base_url + "/v1/messages/batches", headers={"anthropic-version": "2023-06-01"}
    )
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["request_id"] == response.headers["request-id"]


def test_429_on_create_is_retried_then_surfaces(emu):
    set_faults(emu, "429:POST /v1/messages/batches:2")
    batch = anthropic_client(emu, max_retries=2).messages.batches.create(requests=batch_requests(1))
    assert batch.processing_status == "in_progress"
    set_faults(emu, "429:POST /v1/messages/batches:1")
    with pytest.raises(anthropic.RateLimitError) as err:
        anthropic_client(emu, max_retries=0).messages.batches.create(requests=batch_requests(1))
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.body["error"]["type"] == "rate_limit_error"
    assert len(anthropic_client(emu).messages.batches.list().data) == 1


@pytest.mark.parametrize(("status", "error_type"), [(500, "api_error"), (529, "overloaded_error")])
def test_5xx_and_overloaded_are_retried(emu, status, error_type):
    client = anthropic_client(emu, max_retries=2)
    batch = client.messages.batches.create(requests=batch_requests(1))
    set_faults(emu, f"{status}:GET /v1/messages/batches/*:2")
    assert client.messages.batches.retrieve(batch.id).id == batch.id
    set_faults(emu, f"{status}:GET /v1/messages/batches/*:1")
    with pytest.raises(anthropic.APIStatusError) as err:
        anthropic_client(emu).messages.batches.retrieve(batch.id)
    assert err.value.status_code == status and err.value.body["error"]["type"] == error_type


def test_connection_dropped_mid_results_stream(emu):
    client = anthropic_client(emu, max_retries=2)
    batch = client.messages.batches.create(requests=batch_requests(20))
    advance(emu, 100)
    set_faults(emu, "drop:GET /v1/messages/batches/*/results:1")
    seen: list[str] = []
    # The results stream is not retried by the SDK: the cut surfaces after part of the results
    # was already yielded, as a transport error (anthropic < 2.17) or an APIConnectionError.
    with pytest.raises((httpx2.TransportError, anthropic.APIConnectionError)):
        for result in client.messages.batches.results(batch.id):
            seen.append(result.custom_id)
    assert 0 < len(seen) < 20
    again = [r.custom_id for r in client.messages.batches.results(batch.id)]  # resume: full set
    assert len(again) == 20 and set(seen) <= set(again)
