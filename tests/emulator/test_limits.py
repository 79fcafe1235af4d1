"""Account limits through the official SDKs over real HTTP (lowtide/emulator/limits.py):
OpenAI's enqueued-token pool decided on the simulated timeline."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.emulator.conftest import (
    admin,
    advance,
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
