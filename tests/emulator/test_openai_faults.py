"""Injected faults on OpenAI routes, seen through the SDK's own retry logic (items 1, 3, 21, 22)."""

from __future__ import annotations

import logging
import tempfile

import httpx
import openai
import pytest

from lowtide.backends.base import TransientBackendError
from lowtide.backends.openai_batch import _DOWNLOAD_ATTEMPTS, OpenAIBatchBackend
from lowtide.emulator import EmulatorConfig
from lowtide.emulator.config import FaultRule, parse_faults
from tests.emulator.conftest import admin, advance, openai_client, set_faults, upload_batch


def _remaining(emu) -> list[int | None]:
    return [rule["count"] for rule in admin(emu, "GET", "/_emulator/faults")["rules"]]


def test_429_storm_shorter_than_the_retries_is_invisible(emu):
    set_faults(emu, "429:POST /v1/batches:2")
    client = openai_client(emu, max_retries=2)
    file_id, _ = upload_batch(client, n=1)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "validating"
    assert _remaining(emu) == [0]
    assert len(client.batches.list().data) == 1  # the 429s created nothing


def test_429_carries_retry_after_and_the_openai_body(emu):
    set_faults(emu, "429:POST /v1/batches:1")
    client = openai_client(emu, max_retries=0)
    file_id, _ = upload_batch(client, n=1)
    with pytest.raises(openai.RateLimitError) as err:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    headers = err.value.response.headers
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "10"
    assert err.value.code == "rate_limit_exceeded"
    assert err.value.body["type"] == "requests" and "message" in err.value.body
    assert err.value.request_id.startswith("req_")


def test_retry_after_is_honoured(make_emu, caplog):
    emu = make_emu(retry_after_s=0.25)
    set_faults(emu, "429:GET /v1/batches:2")
    client = openai_client(emu, max_retries=2)
    caplog.set_level(logging.INFO, logger="openai._base_client")
    client.batches.list()
    assert _remaining(emu) == [0]  # both 429s were answered, then the list
    # The waits the SDK chose, from its own log line (seconds, retry number, max retries): the
    # header's 0.25 s each time; without it the SDK backs off 0.5 s, then 1 s (less jitter).
    waits = [r.args for r in caplog.records if r.getMessage().startswith("Retrying request")]
    assert waits == [(0.25, 1, 2), (0.25, 2, 2)]


@pytest.mark.parametrize("status", [500, 502, 503, 529])
def test_5xx_is_retried_by_the_sdk(emu, status):
    set_faults(emu, f"{status}:GET /v1/batches/*:2")
    client = openai_client(emu, max_retries=2)
    file_id, _ = upload_batch(client, n=1)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert client.batches.retrieve(batch.id).id == batch.id
    set_faults(emu, f"{status}:GET /v1/batches/*:1")
    with pytest.raises(openai.APIStatusError) as err:
        openai_client(emu, max_retries=0).batches.retrieve(batch.id)
    assert err.value.status_code == status
    assert err.value.body["type"] == "server_error"


def test_connection_dropped_mid_download(emu):
    client = openai_client(emu, max_retries=0)
    file_id, _ = upload_batch(client, n=3)
    full = client.files.content(file_id).content
    set_faults(emu, "drop:GET /v1/files/*/content:1")
    with pytest.raises(openai.APIConnectionError):
        client.files.content(file_id)
    set_faults(emu, "drop:GET /v1/files/*/content:1")
    # files.content is not streamed, so the SDK's retry hides one cut.
    assert openai_client(emu, max_retries=2).files.content(file_id).content == full


def _ended_batch(emu, n: int):
    """A batch of `n` requests run to its end; the backend, its state, and its results read
    once (sorted by custom_id)."""
    client = openai_client(emu, max_retries=0)
    file_id, ids = upload_batch(client, n=n)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    advance(emu, 100_000)
    backend = OpenAIBatchBackend(client)
    state = backend.poll(batch.id)
    whole = backend.results(state).sort("custom_id")
    assert whole["custom_id"].to_list() == ids and set(whole["status"]) == {"answered"}
    return backend, state, whole


def test_results_cut_mid_download_are_read_again_whole(emu):
    """The backend streams a results file to disk; a body cut mid-way is asked for again (the
    SDK retries a request, not a body read in pieces), and past its tries it is transient,
    for the join to retry later."""
    backend, state, whole = _ended_batch(emu, 6)
    set_faults(emu, "drop:GET /v1/files/*/content:2")
    assert backend.results(state).sort("custom_id").equals(whole)
    assert _remaining(emu) == [0]  # both cuts happened, and the third read was whole
    set_faults(emu, f"drop:GET /v1/files/*/content:{_DOWNLOAD_ATTEMPTS}")
    with pytest.raises(TransientBackendError, match="connection dropped while reading"):
        backend.results(state)


def test_results_are_read_in_memory_when_the_temporary_folder_cannot_hold_them(
    emu, tmp_path, monkeypatch
):
    backend, state, whole = _ended_batch(emu, 4)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))  # as a vanished TMPDIR
    assert backend.results(state).sort("custom_id").equals(whole)


def test_missing_auth_is_401_in_openai_envelope(emu):
    response = httpx.get(emu.openai_base_url + "/batches")
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.headers["x-request-id"].startswith("req_")
    # (Plain HTTP: the SDK refuses to send a request without a key.)


def test_unknown_route_is_404_in_openai_envelope(emu):
    response = httpx.get(
        emu.openai_base_url + "/nothing-here", headers={"authorization": "Bearer x"}
    )
    assert response.status_code == 404 and "error" in response.json()


def test_request_id_header_reaches_the_sdk(emu):
    client = openai_client(emu)
    raw = client.batches.with_raw_response.list()
    assert raw.headers["x-request-id"].startswith("req_")
    assert "request-id" not in {k for k in raw.headers if k != "x-request-id"}


def test_fault_spec_grammar():
    rules = parse_faults(
        "429:POST /v1/batches:2, 500:GET /v1/files/*/content, drop:GET /v1/files/*/content:*, slow_finalizing:600"
    )
    assert rules == [
        FaultRule("429", "POST", "/v1/batches", 2),
        FaultRule("500", "GET", "/v1/files/*/content", 1),
        FaultRule("drop", "GET", "/v1/files/*/content", None),
        FaultRule("slow_finalizing", count=None, seconds=600.0),
    ]
    config = EmulatorConfig.from_spec("error_rate:0.2,malformed_rate:0.1,503:GET /v1/batches:1")
    assert (config.error_rate, config.malformed_rate, len(config.faults)) == (0.2, 0.1, 1)
    env = EmulatorConfig.from_env(
        {"LOWTIDE_EMULATOR_TIME_SCALE": "3600", "LOWTIDE_EMULATOR_FAULTS": "429:POST /v1/batches"}
    )
    assert env.time_scale == 3600.0 and env.faults[0].count == 1
    for bad in ("418:GET /x:1", "429:/v1/batches", "429:GET /x:many", "slow_finalizing:soon"):
        with pytest.raises(ValueError):
            parse_faults(bad)


def test_admin_config_patch_and_clock(emu):
    patched = admin(emu, "POST", "/_emulator/config", {"error_rate": 1.0, "model_version": 2})
    assert patched["error_rate"] == 1.0 and emu.state.config.model_version == 2
    before = admin(emu, "GET", "/_emulator/clock")["now"]
    assert advance(emu, 3600) == pytest.approx(before + 3600)
    with pytest.raises(Exception, match="400"):
        admin(emu, "POST", "/_emulator/config", {"no_such_knob": 1})
