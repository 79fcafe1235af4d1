from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from lowtide.jobspec import load_job
from tasks.parse import compile_schema, parse_one, parse_results
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


def test_malformed_folder_ends_valid_or_failed_with_reason(validator) -> None:
    files = sorted(MALFORMED.glob("*.txt"))
    assert files
    for f in files:
        outcome, output, error = parse_one(f.read_text(), "stop", validator)
        assert outcome in ("ok", "repaired", "parse_failed"), f.name
        if outcome == "parse_failed":
            assert error, f.name
        else:
            assert validator.is_valid(__import__("orjson").loads(output)), f.name


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
