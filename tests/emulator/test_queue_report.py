"""`GET /_emulator/queue` on a timeline small enough to work out by hand, and the limits'
state across a restart (lowtide/emulator/limits.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.emulator.conftest import (
    MakeEmulator,
    admin,
    advance,
    anthropic_client,
    batch_requests,
    openai_client,
    upload_batch,
    upload_named_batch,
)

MODEL = "gpt-4o-mini"


def _create(client: openai.OpenAI, file_id: str) -> str:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id


_WHILE_SENDING = ("sending_s", "share_while_sending")


def _report(emu: Any) -> dict[str, Any]:
    """The report without its while-sending fields (`_while_sending` reads those)."""
    report = admin(emu, "GET", "/_emulator/queue")
    return {
        provider: {
            key: {k: v for k, v in entry.items() if k not in _WHILE_SENDING}
            for key, entry in queues.items()
        }
        for provider, queues in report.items()
    }


def _while_sending(emu: Any, provider: str, key: str) -> tuple[float, float | None]:
    entry = admin(emu, "GET", "/_emulator/queue")[provider][key]
    return entry["sending_s"], entry["share_while_sending"]


def _entry(
    limit: int | None, refusals: int, creates: int, busy_s: float, occupied: float
) -> dict[str, Any]:
    share = occupied / (limit * busy_s) if limit and busy_s else None
    return {
        "limit": limit,
        "refusals": refusals,
        "creates": creates,
        "busy_s": busy_s,
        "occupied": occupied,
        "share": pytest.approx(share) if share is not None else None,
    }


def test_queue_report_on_a_hand_computed_timeline(make_emu):
    """Seconds from the reset (test config: validation 10 s, 1 s a request, finalizing 10 s):

    OpenAI, pool = A + B tokens. A (4 requests) created at 0: held 10-24. B and C created at
    5 validate at 15; B (older) is admitted, held 15-29; C no longer fits and is refused.
    Anthropic, queue of 10 requests. P (3) created at 0: queued until its end at 13. Q (2)
    created at 5: until 17. R (6) at 5 would make 11: a 429.
    """
    emu = make_emu(anthropic_queue_limit=10)
    client, aclient = openai_client(emu), anthropic_client(emu)
    a_file, _, a_tokens = upload_named_batch(client, "a")
    b_file, _, b_tokens = upload_named_batch(client, "b")
    c_file, _, _ = upload_named_batch(client, "c")
    limit = a_tokens + b_tokens
    admin(emu, "POST", "/_emulator/config", {"enqueued_token_limit": limit})
    aclient.messages.batches.create(requests=batch_requests(1))  # before the measurement
    advance(emu, 100)
    since = admin(emu, "POST", "/_emulator/queue/reset")["since"]
    assert since == admin(emu, "GET", "/_emulator/clock")["now"]

    _create(client, a_file)
    aclient.messages.batches.create(requests=batch_requests(3))
    advance(emu, 5)
    _create(client, b_file)
    _create(client, c_file)
    aclient.messages.batches.create(requests=batch_requests(2))
    with pytest.raises(anthropic.RateLimitError):
        aclient.messages.batches.create(requests=batch_requests(6))

    advance(emu, 15)  # at 20: A and B still held, counted up to now
    assert _report(emu) == {
        "openai": {MODEL: _entry(limit, 1, 3, 20, 10 * a_tokens + 5 * b_tokens)},
        "anthropic": {"*": _entry(10, 1, 2, 17, 3 * 13 + 2 * 12)},
    }
    advance(emu, 80)  # at 100: everything ended
    report = _report(emu)
    assert report == {
        "openai": {MODEL: _entry(limit, 1, 3, 29, 14 * a_tokens + 14 * b_tokens)},
        "anthropic": {"*": _entry(10, 1, 2, 17, 63)},
    }
    assert report["openai"][MODEL]["share"] == pytest.approx(14 / 29)
    # up to the last create (at 5) only: OpenAI held nothing yet (A is admitted at 10);
    # Anthropic held P's 3 requests for those 5 s of a queue of 10
    assert _while_sending(emu, "openai", MODEL) == (5, 0)
    assert _while_sending(emu, "anthropic", "*") == (5, pytest.approx(0.3))

    admin(emu, "POST", "/_emulator/queue/reset")  # nothing is left to count
    assert _report(emu) == {"openai": {}, "anthropic": {"*": _entry(10, 0, 0, 0, 0)}}


def test_a_batch_running_across_a_reset_counts_from_the_reset(make_emu):
    emu = make_emu(enqueued_token_limit=10_000)
    client = openai_client(emu)
    file_id, _, tokens = upload_named_batch(client, "d")
    _create(client, file_id)  # held from 10 to 24
    advance(emu, 12)
    admin(emu, "POST", "/_emulator/queue/reset")
    advance(emu, 100)
    entry = _report(emu)["openai"][MODEL]
    assert entry == _entry(10_000, 0, 0, 12, 12 * tokens)


def test_unlimited_queues_are_measured_without_a_share(emu):
    client = openai_client(emu)
    file_id, _, tokens = upload_named_batch(client, "e", n=2)
    _create(client, file_id)  # held from 10 to 22
    advance(emu, 100)
    assert _report(emu)["openai"] == {MODEL: _entry(None, 0, 1, 22, 12 * tokens)}


def test_limits_and_the_measurement_survive_a_restart(
    make_emu: MakeEmulator, tmp_path: Path
) -> None:
    folder = str(tmp_path / "emu")
    limits = {"batch_creates_per_hour": 1, "anthropic_queue_limit": 2}
    first = make_emu(state_dir=folder, **limits)
    client, aclient = openai_client(first), anthropic_client(first)
    file_id, _ = upload_batch(client, n=1)
    advance(first, 50)
    admin(first, "POST", "/_emulator/queue/reset")
    _create(client, file_id)
    aclient.messages.batches.create(requests=batch_requests(2))
    advance(first, 5)
    with pytest.raises(anthropic.RateLimitError):  # the last change before the restart
        aclient.messages.batches.create(requests=batch_requests(1))
    report = _report(first)
    assert report["anthropic"]["*"]["refusals"] == 1
    first.stop()

    second = make_emu(state_dir=folder, **limits)
    assert _report(second) == report
    with pytest.raises(openai.RateLimitError) as err:  # the create 5 s ago still holds the hour
        _create(openai_client(second), file_id)
    assert err.value.response.headers["retry-after-ms"] == "3595000"
