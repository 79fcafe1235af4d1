from __future__ import annotations

from pathlib import Path

import orjson
import polars as pl
import pytest

from lowtide.jobspec import load_job
from lowtide.pricing import Price
from tasks.parse import _result_rows, answered_by, compile_schema, parse_one, parse_results
from tests.conftest import SAMPLE_JOB

MALFORMED = Path(__file__).resolve().parents[1] / "fixtures" / "malformed"


@pytest.fixture(scope="module")
def validator():
    return compile_schema(load_job(SAMPLE_JOB).output_schema)


GOOD = '{"intent": "refund_request", "urgency": "normal", "summary": "wants money back"}'


@pytest.mark.parametrize(
    "raw,finish,outcome",
    [
        (GOOD, "stop", "ok"),
        ("```json\n" + GOOD + "\n```", "stop", "repaired"),
        (GOOD.replace('back"', 'back",'), "stop", "repaired"),
        (GOOD.replace('"', "'"), "stop", "repaired"),
        (
            '{"intent": "refund_request", "urgency": "normal", "summary": "wants mo',
            "length",
            "repaired",
        ),
        ('{"intent": "refund_request", "urg', "length", "parse_failed"),
        ('{"intent": "teleport", "urgency": "normal", "summary": "x"}', "stop", "parse_failed"),
        ("I cannot help with that.", "stop", "parse_failed"),
        (None, "stop", "parse_failed"),
    ],
)
def test_repair_ladder(validator, raw, finish, outcome) -> None:
    got, output, error = parse_one(raw, finish, validator)
    assert got == outcome
    assert (output is None) == (outcome == "parse_failed")
    assert (error is None) == (outcome != "parse_failed")


def test_truncated_answers_say_so(validator) -> None:
    _, _, error = parse_one('{"intent": "refund_request", "urg', "length", validator)
    assert error.startswith("truncated at max_tokens")


# Each real malformed answer: what the ladder must make of it. Repaired ones keep the
# model's values; failed ones say why (the error's start).
MALFORMED_EXPECTED = {
    "code_fence.txt": (
        "repaired",
        {"intent": "billing_issue", "urgency": "low", "summary": "charged twice"},
    ),
    "extra_key.txt": ("parse_failed", "schema: at (root): Additional properties"),
    "preamble.txt": (
        "repaired",
        {"intent": "cancel_subscription", "urgency": "normal", "summary": "stop my plan"},
    ),
    "single_quotes.txt": (
        "repaired",
        {"intent": "order_status", "urgency": "low", "summary": "where is my parcel"},
    ),
    "trailing_comma.txt": (
        "repaired",
        {"intent": "damaged_item", "urgency": "normal", "summary": "box arrived crushed"},
    ),
    "truncated_early.txt": ("parse_failed", "json: unexpected end of data"),
    "truncated_string.txt": (
        "repaired",
        {"intent": "complaint", "urgency": "urgent", "summary": "rude agent on the ph"},
    ),
    "wrong_enum_case.txt": ("parse_failed", 'schema: at intent: "REFUND" is not one of'),
}


def test_malformed_folder_has_an_expectation_per_file() -> None:
    assert sorted(f.name for f in MALFORMED.glob("*.txt")) == sorted(MALFORMED_EXPECTED)


@pytest.mark.parametrize("name", sorted(MALFORMED_EXPECTED))
def test_malformed_folder_ends_valid_or_failed_with_reason(validator, name: str) -> None:
    expected_outcome, expected = MALFORMED_EXPECTED[name]
    outcome, output, error = parse_one((MALFORMED / name).read_text(), "stop", validator)
    assert outcome == expected_outcome
    if outcome == "parse_failed":
        assert output is None and error.startswith(expected)
    else:
        assert error is None and orjson.loads(output) == expected
        assert validator.is_valid(orjson.loads(output))


def test_provider_outcomes_pass_through(validator) -> None:
    joined = pl.DataFrame(
        {
            "custom_id": ["a", "b", "c"],
            "status": ["answered", "provider_error", "missing"],
            "raw_text": [GOOD, None, None],
            "finish_reason": ["stop", None, None],
            "error": [None, "HTTP 500 server_error: boom", "no result"],
            "input_tokens": [1, None, None],
            "cached_tokens": [0, None, None],
            "output_tokens": [1, None, None],
        }
    )
    out = parse_results(joined, load_job(SAMPLE_JOB).output_schema)
    assert out["outcome"].to_list() == ["ok", "provider_error", "missing"]
    assert out["error"].to_list() == [None, "HTTP 500 server_error: boom", "no result"]


def test_an_answer_signed_by_the_emulator_is_the_emulators_whoever_asked() -> None:
    parsed = pl.DataFrame({"emulated": [True, False, None]}, schema={"emulated": pl.Boolean})
    engines = parsed.select(answered_by(parsed, "openai:gpt-4o-mini").alias("e"))["e"].to_list()
    assert engines == ["emulator", "openai:gpt-4o-mini", "openai:gpt-4o-mini"]


def test_batch_results_are_priced_as_stored_and_the_rest_left_to_reconcile(validator) -> None:
    joined = pl.DataFrame(
        {
            "custom_id": ["a", "b"],
            "status": ["answered", "provider_error"],
            "raw_text": [GOOD, None],
            "finish_reason": ["stop", None],
            "error": [None, "HTTP 500 server_error: boom"],
            "input_tokens": [1_000_000, None],
            "cached_tokens": [400_000, None],
            "output_tokens": [10_000, None],
        }
    )
    parsed = parse_results(joined, load_job(SAMPLE_JOB).output_schema)
    attempts = pl.DataFrame({"custom_id": ["a"], "attempts": [2]})
    price = Price("openai", "m", "2026-01-01", 2.0, 1.0, 8.0, 0.5)
    ids = {"batch_id": "b1", "run_id": "r1", "engine": "openai:m"}

    batch = _result_rows(parsed, attempts, **ids, channel="batch", price=price)
    # (600k fresh × $2 + 400k cached × $1 + 10k out × $8) / 1M, at half price
    assert batch["cost_usd"].to_list() == [pytest.approx(0.84), None]  # no usage: no price
    # a pool's rows are priced by GPU time, and without a price nothing is
    pool = _result_rows(parsed, attempts, **ids, channel="pool", price=price)
    assert pool["cost_usd"].to_list() == [None, None]
    assert _result_rows(parsed, attempts, **ids, channel="batch")["cost_usd"].null_count() == 2


def test_each_row_keeps_its_own_outcome_when_answers_repeat() -> None:
    # repeated answers are parsed once; every row still gets its own outcome and reason, in order
    broken = '{"intent": "teleport", "urgency": "normal", "summary": "x"}'
    joined = pl.DataFrame(
        {
            "custom_id": ["a", "b", "c", "d", "e", "f", "g", "h", "i"],
            "status": [
                "answered",
                "answered",
                "answered",
                "answered",
                "answered",
                "missing",
                "answered",
                "answered",
                None,  # no status at all: missing, with its own reason
            ],
            "raw_text": [GOOD, broken, GOOD, broken, GOOD, None, GOOD, None, None],
            "finish_reason": ["stop", "stop", "stop", "stop", "length", None, "stop", None, None],
            "error": [
                None,
                "refusal: no",
                None,
                None,
                None,
                "no result",
                "refusal: no",
                None,
                "lost",
            ],
        }
    )
    out = parse_results(joined, load_job(SAMPLE_JOB).output_schema)
    assert out["custom_id"].to_list() == ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
    assert out["outcome"].to_list() == [
        "ok",
        "parse_failed",
        "ok",
        "parse_failed",
        "ok",
        "missing",
        "ok",
        "parse_failed",
        "missing",
    ]
    errors = out["error"].to_list()
    assert errors[0] is None and errors[2] is None and errors[6] is None
    assert errors[7] == "empty answer" and errors[8] == "lost"
    assert errors[1].startswith("refusal: no; schema:") and errors[3].startswith("schema:")
    assert errors[5] == "no result"
    assert out["output"][0] == out["output"][2] and out["output"][5] is None
