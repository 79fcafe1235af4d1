"""The Anthropic Message Batches backend: pure tables, then the real SDK over real HTTP to the
emulator (frozen clock, advanced by hand so every transition lands where the test says)."""

from __future__ import annotations

from typing import Any

import anthropic
import jsonschema
import orjson
import polars as pl
import pytest
from anthropic.types.messages import MessageBatchIndividualResponse

from lowtide.backends import anthropic_batch, make_backend
from lowtide.backends.anthropic_batch import (
    STREAM_CUT_ERRORS,
    AnthropicBatchBackend,
    finish_reason,
    map_status,
)
from lowtide.backends.anthropic_params import batch_requests, to_anthropic_params
from lowtide.backends.base import (
    RESULT_SCHEMA,
    BatchStatus,
    TerminalBackendError,
    TransientBackendError,
)
from lowtide.backends.wire import EMULATOR_FINGERPRINT
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.errors import CredentialsError
from lowtide.jobspec import JobSpec
from tasks.assemble import openai_lines
from tests.conftest import REPO
from tests.emulator.conftest import admin, advance, set_faults
from tests.key_guard import RequireKey

# --------------------------------------------------------------------------- helpers


def sample_lines(job: JobSpec, n: int) -> list[str]:
    """n stored request lines for the sample job, built by the real assembler."""
    rows = pl.read_csv(REPO / "data" / "support" / "messages.csv").head(n)
    users = [
        job.prompt.user_template.format(text=body, channel=channel)
        for body, channel in zip(rows["body"], rows["channel"], strict=True)
    ]
    requests = pl.DataFrame(
        {
            "custom_id": [f"lt1_{i:04d}" for i in range(n)],
            "request_key": [str(i) for i in range(n)],
            "user": users,
            "unit_tokens": [None] * n,
        },
        schema_overrides={"unit_tokens": pl.Int32},
    )
    return openai_lines(job, requests).to_list()


def ids_of(lines: list[str]) -> list[str]:
    return [orjson.loads(line)["custom_id"] for line in lines]


@pytest.fixture
def emu(make_emu: Any) -> Emulator:
    return make_emu()


def backend_for(emu: Emulator, **kw: Any) -> AnthropicBatchBackend:
    return anthropic_batch.for_base_url(emu.anthropic_base_url, **kw)


def run_to_end(emu: Emulator, backend: AnthropicBatchBackend, lines: list[str]) -> Any:
    """Create a batch from `lines`, push the clock past its end, return the final state."""
    batch = backend.create("b1", backend.upload("b1", lines), lines)
    advance(emu, 10_000)
    return backend.poll(batch)


# --------------------------------------------------------------------------- pure tables


def counts(**kw: int) -> dict[str, int]:
    return {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0, **kw}


@pytest.mark.parametrize(
    "provider,request_counts,ours",
    [
        ("in_progress", counts(processing=5), BatchStatus.IN_PROGRESS),
        ("canceling", counts(processing=5), BatchStatus.CANCELLING),
        ("ended", counts(succeeded=5), BatchStatus.COMPLETED),
        ("ended", counts(succeeded=3, errored=2), BatchStatus.COMPLETED),
        ("ended", counts(succeeded=3, expired=2), BatchStatus.EXPIRED),
        ("ended", counts(succeeded=1, canceled=4), BatchStatus.CANCELLED),
        ("ended", counts(canceled=2, expired=3), BatchStatus.CANCELLED),
        ("ended", None, BatchStatus.COMPLETED),
    ],
)
def test_status_table(
    provider: str, request_counts: dict[str, int] | None, ours: BatchStatus
) -> None:
    assert map_status(provider, request_counts) is ours


def test_unknown_status_is_terminal_error() -> None:
    with pytest.raises(TerminalBackendError, match="processing_status 'paused'"):
        map_status("paused", counts())


@pytest.mark.parametrize(
    "stop_reason,expected",
    [
        ("end_turn", "stop"),
        ("tool_use", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("model_context_window_exceeded", "length"),
        ("refusal", "content_filter"),
        (None, None),
    ],
)
def test_finish_reason_table(stop_reason: str | None, expected: str | None) -> None:
    assert finish_reason(stop_reason) == expected


SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["a", "b"]}},
    "required": ["label"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "label_out", "strict": True, "schema": SCHEMA},
}
FEW_SHOT = [
    {"role": "system", "content": "Label it."},
    {"role": "user", "content": "ex 1"},
    {"role": "assistant", "content": '{"label": "a"}'},
    {"role": "user", "content": "ex 2"},
    {"role": "assistant", "content": '{"label": "b"}'},
    {"role": "user", "content": "the unit"},
]
EPHEMERAL = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "Label it."}]
# the one breakpoint closes the repeated prefix: the last block of the last few-shot turn
TURNS = [
    *FEW_SHOT[1:4],
    {
        "role": "assistant",
        "content": [{"type": "text", "text": '{"label": "b"}', "cache_control": EPHEMERAL}],
    },
    FEW_SHOT[5],
]


def body(**kw: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": FEW_SHOT,
        "temperature": 0.0,
        "max_tokens": 50,
        "response_format": RESPONSE_FORMAT,
        **kw,
    }


TRANSLATIONS = {
    "output_config: few-shot order, breakpoint after the examples, max_tokens": (
        body(),
        "output_config",
        {
            "model": "m",
            "max_tokens": 50,
            "system": SYSTEM,
            "messages": TURNS,
            "temperature": 0.0,
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
    ),
    "tool: strict forced tool named after the schema": (
        body(),
        "tool",
        {
            "model": "m",
            "max_tokens": 50,
            "system": SYSTEM,
            "messages": TURNS,
            "temperature": 0.0,
            "tools": [{"name": "label_out", "input_schema": SCHEMA, "strict": True}],
            "tool_choice": {"type": "tool", "name": "label_out"},
        },
    ),
    "only the last of several system messages is the breakpoint": (
        {
            "model": "m",
            "max_completion_tokens": 9,
            "messages": [
                {"role": "system", "content": "one"},
                {"role": "developer", "content": [{"type": "text", "text": "two"}]},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            ],
        },
        "output_config",
        {
            "model": "m",
            "max_tokens": 9,
            "system": [
                {"type": "text", "text": "one"},
                {"type": "text", "text": "two", "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        },
    ),
    "OpenAI-only keys dropped, known Anthropic keys kept, stop translated": (
        body(
            response_format={"type": "json_object"},
            n=1,
            logprobs=True,
            seed=7,
            presence_penalty=0.1,
            enable_thinking=False,
            top_k=5,
            metadata={"user_id": "u1"},
            stop="END",
            output_config={"effort": "low"},
        ),
        "output_config",
        {
            "model": "m",
            "max_tokens": 50,
            "system": SYSTEM,
            "messages": TURNS,
            "temperature": 0.0,
            "stop_sequences": ["END"],
            "top_k": 5,
            "metadata": {"user_id": "u1"},
            "output_config": {"effort": "low"},
        },
    ),
    "an extra output_config is merged with the schema format": (
        body(output_config={"effort": "low"}),
        "output_config",
        {
            "model": "m",
            "max_tokens": 50,
            "system": SYSTEM,
            "messages": TURNS,
            "temperature": 0.0,
            "output_config": {
                "effort": "low",
                "format": {"type": "json_schema", "schema": SCHEMA},
            },
        },
    ),
    "no system message, no schema": (
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
        "tool",
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
    ),
    "examples without a system prompt: the breakpoint on the last text part": (
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "ex"},
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "user", "content": "x"},
            ],
        },
        "output_config",
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "user", "content": "ex"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "text", "text": "b", "cache_control": EPHEMERAL},
                    ],
                },
                {"role": "user", "content": "x"},
            ],
        },
    ),
    "an empty last example cannot be cached: the breakpoint stays on the system": (
        {
            "model": "m",
            "max_tokens": 5,
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "ex"},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": "x"},
            ],
        },
        "output_config",
        {
            "model": "m",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "s", "cache_control": EPHEMERAL}],
            "messages": [
                {"role": "user", "content": "ex"},
                {"role": "assistant", "content": ""},
                {"role": "user", "content": "x"},
            ],
        },
    ),
}


@pytest.mark.parametrize("case", list(TRANSLATIONS))
def test_line_translation_table(case: str) -> None:
    source, mode, expected = TRANSLATIONS[case]
    params = to_anthropic_params(source, mode)
    assert params == expected
    assert list(params["messages"]) == list(expected["messages"])  # order kept


@pytest.mark.parametrize(
    "source,mode,message",
    [
        (body(), "json_schema", "unknown structured_output 'json_schema'"),
        (body(max_tokens=None), "output_config", "needs max_tokens"),
        (
            body(messages=[{"role": "tool", "content": "x"}]),
            "output_config",
            "role 'tool' has no Anthropic equivalent",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "output_config",
            "content part 'image_url' is not supported",
        ),
    ],
)
def test_untranslatable_lines_are_terminal(source: dict[str, Any], mode: str, message: str) -> None:
    with pytest.raises(TerminalBackendError, match=message):
        to_anthropic_params(source, mode)


def test_sample_job_lines_keep_a_cacheable_prefix(job: JobSpec) -> None:
    lines = sample_lines(job, 3)
    requests = batch_requests(lines, "output_config")
    assert [r["custom_id"] for r in requests] == ids_of(lines)
    prefixes = {
        orjson.dumps([r["params"]["system"], r["params"]["messages"][:-1]]) for r in requests
    }
    assert len(prefixes) == 1  # identical system + few-shot prefix in every request
    params = requests[0]["params"]
    # one breakpoint, after the last example: only the unit's own message is left uncached
    assert orjson.dumps(params).count(b'"cache_control"') == 1
    assert params["messages"][-2]["content"][-1]["cache_control"] == EPHEMERAL
    assert params["messages"][-2]["content"][-1]["text"] == job.prompt.examples[-1].assistant
    assert "cache_control" not in params["system"][-1]
    assert params["system"][0]["text"] == job.prompt.system
    # the stored lines, whose content gives the request keys and custom_ids, are untouched
    assert all(b"cache_control" not in line.encode() for line in lines)
    assert len(params["messages"]) == 2 * len(job.prompt.examples) + 1
    assert params["messages"][-1]["role"] == "user"
    assert params["max_tokens"] == job.model.max_tokens
    assert params["output_config"]["format"]["schema"] == job.output_schema
    # the repeated prefix is shared between requests, not copied, and that is invisible
    assert requests[1]["params"]["system"][0]["text"] is params["system"][0]["text"]
    assert requests == [
        {"custom_id": c, "params": to_anthropic_params(orjson.loads(line)["body"], "output_config")}
        for c, line in zip(ids_of(lines), lines, strict=True)
    ]


def _usage(**kw: int) -> dict[str, int]:
    return {
        "input_tokens": 9,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 2,
        **kw,
    }


def _succeeded(content: list[dict[str, Any]], stop_reason: str, **usage: int) -> dict[str, Any]:
    return {
        "type": "succeeded",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": _usage(**usage),
        },
    }


TEXT = [{"type": "text", "text": '{"label": "a"}'}]
TOOL = [{"type": "tool_use", "id": "toolu_1", "name": "label_out", "input": {"label": "b"}}]
RESULT_ROWS = {
    "text answer, tokens include cache writes and reads": (
        _succeeded(TEXT, "end_turn", cache_creation_input_tokens=100, cache_read_input_tokens=2000),
        "output_config",
        ("answered", '{"label": "a"}', "stop", None, 2109, 2000, 2, False),
    ),
    "truncated": (
        _succeeded(TEXT, "max_tokens"),
        "output_config",
        ("answered", '{"label": "a"}', "length", None, 9, 0, 2, False),
    ),
    "signed by lowtide's emulator (an extra field the SDK keeps)": (
        {
            **_succeeded(TEXT, "end_turn"),
            "message": {
                **_succeeded(TEXT, "end_turn")["message"],
                "system_fingerprint": EMULATOR_FINGERPRINT,
            },
        },
        "output_config",
        ("answered", '{"label": "a"}', "stop", None, 9, 0, 2, True),
    ),
    "forced tool input as JSON": (
        _succeeded(TOOL, "tool_use"),
        "tool",
        ("answered", '{"label":"b"}', "stop", None, 9, 0, 2, False),
    ),
    "refusal": (
        _succeeded([{"type": "text", "text": "no"}], "refusal"),
        "output_config",
        ("answered", "no", "content_filter", "refusal: no", 9, 0, 2, False),
    ),
    "errored": (
        {
            "type": "errored",
            "error": {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "max_tokens: too big"},
                "request_id": "req_1",
            },
        },
        "output_config",
        (
            "provider_error",
            None,
            None,
            "invalid_request_error: max_tokens: too big",
            None,
            None,
            None,
            None,
        ),
    ),
}


@pytest.mark.parametrize("case", list(RESULT_ROWS))
def test_result_row_table(case: str) -> None:
    result, mode, expected = RESULT_ROWS[case]
    item = MessageBatchIndividualResponse.model_validate({"custom_id": "c1", "result": result})
    row = anthropic_batch.result_row(item, mode)
    assert row["custom_id"] == "c1"
    assert tuple(row[k] for k in list(RESULT_SCHEMA)[1:]) == expected


# --------------------------------------------------------------------------- through the emulator


def assert_valid_answers(frame: pl.DataFrame, schema: dict[str, Any]) -> None:
    answered = frame.filter(pl.col("status") == "answered")
    assert answered.height > 0
    for raw in answered["raw_text"]:
        jsonschema.validate(orjson.loads(raw), schema)
    assert set(answered["finish_reason"]) == {"stop"}


def test_whole_batch_every_id_once_valid_and_cached(make_emu: Any, job: JobSpec) -> None:
    emu = make_emu()
    backend = backend_for(emu)
    lines = sample_lines(job, 30)
    assert backend.upload("b1", lines) is None  # no upload step
    provider_id = backend.create("b1", None, lines)
    assert provider_id.startswith("msgbatch_")

    state = backend.poll(provider_id)
    assert state.status is BatchStatus.IN_PROGRESS and state.result_ref is None
    assert state.counts["processing"] == 30 and state.counts["total"] == 30
    assert backend.results(state).height == 0  # nothing to read before the end

    advance(emu, 10)  # 10 of 30 requests have run; counts still say processing
    assert backend.poll(provider_id).status is BatchStatus.IN_PROGRESS
    advance(emu, 10_000)
    state = backend.poll(provider_id)
    assert state.status is BatchStatus.COMPLETED and state.provider_status == "ended"
    assert state.counts["succeeded"] == 30 and state.result_ref == provider_id

    frame = backend.results(state)
    assert sorted(frame["custom_id"]) == sorted(ids_of(lines))  # each exactly once
    assert set(frame["status"]) == {"answered"}
    assert frame["emulated"].all()  # the emulator signs its answers; the SDK keeps the mark
    assert_valid_answers(frame, job.output_schema)

    # Prompt caching: the first request writes the cached system prompt, the later ones read
    # it; input_tokens counts cached tokens too (OpenAI's convention).
    by_id = {r["custom_id"]: r for r in frame.iter_rows(named=True)}
    first, *later = ids_of(lines)
    assert by_id[first]["cached_tokens"] == 0
    cached = {by_id[c]["cached_tokens"] for c in later}
    assert len(cached) == 1 and cached.pop() > 500
    assert all(by_id[c]["input_tokens"] > by_id[c]["cached_tokens"] for c in by_id)
    billed = emu.ledger.total_usage("anthropic")
    assert billed["input_tokens"] == frame["input_tokens"].sum()
    assert billed["cached_input_tokens"] == frame["cached_tokens"].sum()
    assert billed["output_tokens"] == frame["output_tokens"].sum()
    assert emu.ledger.count_by_custom_id() == dict.fromkeys(ids_of(lines), 1)


def test_forced_tool_mode_answers_with_the_tool_input(emu: Emulator, job: JobSpec) -> None:
    backend = backend_for(emu, structured_output="tool")
    assert backend.capabilities.structured_output == "tool"
    lines = sample_lines(job, 8)
    frame = backend.results(run_to_end(emu, backend, lines))
    assert sorted(frame["custom_id"]) == sorted(ids_of(lines))
    assert_valid_answers(frame, job.output_schema)


def test_errored_results_are_provider_errors(make_emu: Any, job: JobSpec) -> None:
    emu = make_emu(error_rate=0.3)
    backend = backend_for(emu)
    lines = sample_lines(job, 40)
    state = run_to_end(emu, backend, lines)
    assert state.status is BatchStatus.COMPLETED  # per-request errors do not fail the batch
    frame = backend.results(state)
    errored = frame.filter(pl.col("status") == "provider_error")
    assert errored.height == state.counts["errored"] > 0
    assert set(errored["error"]) == {"api_error: Internal server error"}
    assert errored["raw_text"].null_count() == errored.height
    assert frame.height == 40 and frame["custom_id"].n_unique() == 40
    assert_valid_answers(frame, job.output_schema)


def test_expiry_keeps_partial_results(make_emu: Any, job: JobSpec) -> None:
    emu = make_emu(completion_window_s=5.5)  # 1 s per request: 5 of 10 run in the window
    backend = backend_for(emu)
    lines = sample_lines(job, 10)
    state = run_to_end(emu, backend, lines)
    assert state.status is BatchStatus.EXPIRED
    assert (state.counts["succeeded"], state.counts["expired"]) == (5, 5)
    frame = backend.results(state)
    statuses = dict(zip(frame["custom_id"], frame["status"], strict=True))
    assert [statuses[c] for c in ids_of(lines)] == ["answered"] * 5 + ["expired"] * 5
    assert frame.filter(pl.col("status") == "expired")["error"].str.contains("24 h").all()


def test_cancel_keeps_finished_work(emu: Emulator, job: JobSpec) -> None:
    backend = backend_for(emu)
    lines = sample_lines(job, 10)
    provider_id = backend.create("b1", None, lines)
    advance(emu, 3.5)  # three requests done, the fourth running
    backend.cancel(provider_id)
    assert backend.poll(provider_id).status is BatchStatus.CANCELLING
    advance(emu, 10_000)
    state = backend.poll(provider_id)
    assert state.status is BatchStatus.CANCELLED
    frame = backend.results(state)
    assert frame.height == 10 and frame["custom_id"].n_unique() == 10
    statuses = dict(zip(frame["custom_id"], frame["status"], strict=True))
    # the request in flight when the cancel came may still finish
    assert [statuses[c] for c in ids_of(lines)] == ["answered"] * 4 + ["cancelled"] * 6
    assert len(emu.ledger.count_by_custom_id()) == 4  # the canceled ones were never billed
    with pytest.raises(TerminalBackendError, match="already ended"):
        backend.cancel(provider_id)


def test_find_reattaches_to_a_batch_created_before_a_crash(emu: Emulator, job: JobSpec) -> None:
    lines = sample_lines(job, 6)
    not_before = admin(emu, "GET", "/_emulator/clock")["now"]
    backend_for(emu).create("b1", None, lines[:2])  # another, smaller batch
    lost = backend_for(emu).create("b1", None, lines)  # ...the process dies before recording
    backend_for(emu).create("b2", None, lines[:3])

    restarted = backend_for(emu)
    assert restarted.find("b1", 6, not_before) == lost
    assert restarted.find("b1", 6, not_before, exclude={lost}) is None
    assert restarted.find("b1", 5, not_before) is None  # no batch of that size
    # a batch older than not_before (minus the slack) is never taken for this one
    assert restarted.find("b1", 6, not_before + 60) is None


def test_find_prefers_the_newest_same_sized_batch(emu: Emulator, job: JobSpec) -> None:
    lines = sample_lines(job, 4)
    not_before = admin(emu, "GET", "/_emulator/clock")["now"]
    backend = backend_for(emu)
    older = backend.create("s0", None, lines)
    newer = backend.create("s1", None, lines)
    assert backend.find("s1", 4, not_before) == newer
    assert backend.find("s0", 4, not_before, exclude={newer}) == older


def test_results_stream_cut_midway_is_resumed_without_duplicates(
    emu: Emulator, job: JobSpec
) -> None:
    backend = backend_for(emu)
    lines = sample_lines(job, 40)
    state = run_to_end(emu, backend, lines)
    expected = backend.results(state).sort("custom_id")
    set_faults(emu, "drop:GET /v1/messages/batches/*/results:2")
    frame = backend.results(state)
    assert admin(emu, "GET", "/_emulator/faults")["rules"][0]["count"] == 0  # both cuts hit
    assert frame.height == 40 and frame["custom_id"].n_unique() == 40
    assert frame.sort("custom_id").equals(expected)


def test_results_stream_cut_every_time_is_transient(emu: Emulator, job: JobSpec) -> None:
    backend = backend_for(emu)
    backend.results_attempts = 3
    state = run_to_end(emu, backend, sample_lines(job, 20))
    set_faults(emu, "drop:GET /v1/messages/batches/*/results:*")
    with pytest.raises(TransientBackendError, match="was cut 3 times") as info:
        backend.results(state)
    assert isinstance(info.value.__cause__, STREAM_CUT_ERRORS)
    assert "peer closed connection" in str(info.value)
    assert info.value.operation == "download"


def test_429_on_create_is_not_retried_blindly(emu: Emulator, job: JobSpec) -> None:
    """A create is never re-POSTed by the SDK (a timed-out create may have been accepted): the
    error is transient, so the caller's task retry asks the provider (find) before creating."""
    backend = backend_for(emu)
    lines = sample_lines(job, 3)
    set_faults(emu, "429:POST /v1/messages/batches:1")
    with pytest.raises(TransientBackendError) as info:
        backend.create("b1", None, lines)
    assert isinstance(info.value.__cause__, anthropic.RateLimitError)
    assert admin(emu, "GET", "/_emulator/faults")["rules"][0]["count"] == 0  # one call only
    provider_id = backend.create("b1", None, lines)  # the retry, after the 429 passed
    assert backend.poll(provider_id).counts["total"] == 3


@pytest.mark.parametrize(
    "fault,cause,error",
    [
        ("500:GET /v1/messages/batches/*", anthropic.InternalServerError, TransientBackendError),
        ("529:GET /v1/messages/batches/*", anthropic.InternalServerError, TransientBackendError),
        ("503:GET /v1/messages/batches/*", anthropic.InternalServerError, TransientBackendError),
        ("429:GET /v1/messages/batches/*", anthropic.RateLimitError, TransientBackendError),
        (None, anthropic.NotFoundError, TerminalBackendError),
    ],
)
def test_errors_are_translated_once_keeping_the_cause(
    emu: Emulator, fault: str | None, cause: type[Exception], error: type[Exception]
) -> None:
    backend = AnthropicBatchBackend(
        anthropic.Anthropic(base_url=emu.anthropic_base_url, api_key="x", max_retries=0)
    )
    if fault:
        set_faults(emu, fault)
    with pytest.raises(error) as info:
        backend.poll("msgbatch_unknown")
    assert isinstance(info.value.__cause__, cause)
    assert info.value.backend == "anthropic" and info.value.operation == "poll"


@pytest.mark.parametrize("status", [401, 403])
def test_a_refused_key_is_a_credentials_error_without_the_key(status: int) -> None:
    """Not a terminal refusal of the batch (the run stays resumable: tasks/submit.py); the key
    the provider echoed back is taken out of the message."""
    sent = f"sk-ant-test-{status}-not-the-one"
    emu = Emulator(EmulatorConfig(time_scale=600.0))
    emu.app = RequireKey(emu.app, "sk-ant-the-right-one", status=status, echo=True)
    with emu:
        backend = AnthropicBatchBackend(
            anthropic.Anthropic(base_url=emu.anthropic_base_url, api_key=sent, max_retries=0)
        )
        refused = rf"anthropic refused the API key \(HTTP {status}"
        with pytest.raises(CredentialsError, match=refused) as info:
            backend.poll("msgbatch_any")
    assert isinstance(info.value.__cause__, anthropic.APIStatusError)
    assert sent not in str(info.value) and "Incorrect API key provided: <key>" in str(info.value)


def test_bad_custom_id_is_terminal(emu: Emulator, job: JobSpec) -> None:
    line = orjson.loads(sample_lines(job, 1)[0])
    line["custom_id"] = "has:colon"
    with pytest.raises(TerminalBackendError, match="custom_id") as info:
        backend_for(emu).create("b1", None, [orjson.dumps(line).decode()])
    assert isinstance(info.value.__cause__, anthropic.BadRequestError)


def test_missing_key_says_where_it_looked() -> None:
    with pytest.raises(
        TerminalBackendError,
        match=r"set ANTHROPIC_API_KEY \(looked in: environment\)\. For a dry run",
    ):
        make_backend("anthropic")


def test_from_environment_honours_the_sdk_variables(
    emu: Emulator, job: JobSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", emu.anthropic_base_url)
    backend = make_backend("anthropic")
    assert backend.capabilities == anthropic_batch.CAPABILITIES
    provider_id = backend.create("b1", None, sample_lines(job, 2))
    assert backend.poll(provider_id).status is BatchStatus.IN_PROGRESS
