from __future__ import annotations

import re

import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.dedupe import request_keys, unique_requests

TEMPLATE = "Channel: {channel}\n\n{text}"
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _units(texts: list[str], channels: list[str] | None = None) -> pl.DataFrame:
    n = len(texts)
    return pl.DataFrame(
        {
            "unit_id": [f"r{i}#0" for i in range(n)],
            "source_id": [f"r{i}" for i in range(n)],
            "kind": ["row"] * n,
            "text": texts,
            "channel": channels or ["email"] * n,
            "unit_tokens": [None] * n,
        },
        schema_overrides={"unit_tokens": pl.Int32, "text": pl.String, "channel": pl.String},
    )


def test_case_and_whitespace_duplicates_share_one_request() -> None:
    keyed = request_keys(
        _units(["Refund  please", "refund please\n", "REFUND PLEASE", "other"]), TEMPLATE, "fp"
    )
    ids = keyed["custom_id"].to_list()
    assert ids[0] == ids[1] == ids[2] != ids[3]
    uniq = unique_requests(keyed)
    assert uniq.height == 2
    assert uniq["user"][0] == "Channel: email\n\nRefund  please"  # the first row's own text is sent


def test_template_columns_and_prompt_are_part_of_the_key() -> None:
    a = request_keys(_units(["same"], ["email"]), TEMPLATE, "fp")["custom_id"][0]
    b = request_keys(_units(["same"], ["chat"]), TEMPLATE, "fp")["custom_id"][0]
    c = request_keys(_units(["same"], ["email"]), TEMPLATE, "other-fp")["custom_id"][0]
    assert len({a, b, c}) == 3


def test_custom_ids_fit_both_providers_and_are_versioned() -> None:
    ids = request_keys(_units(["x", "y"]), TEMPLATE, "fp")["custom_id"].to_list()
    assert all(CUSTOM_ID.match(i) and i.startswith("lt1_") for i in ids)


TEXTS = st.lists(
    st.sampled_from(["a", "A ", "b", " b", "ccc", "Zoë", "zoë", "x  y", "x y"]), max_size=30
)


@given(texts=TEXTS, seed=st.randoms())
@settings(max_examples=50, deadline=None)
def test_dedupe_is_order_independent_and_idempotent(texts: list[str], seed) -> None:
    units = _units(texts)
    keys = set(unique_requests(request_keys(units, TEMPLATE, "fp"))["custom_id"].to_list())
    shuffled = units.sample(fraction=1.0, shuffle=True, seed=seed.randint(0, 10**6))
    assert (
        set(unique_requests(request_keys(shuffled, TEMPLATE, "fp"))["custom_id"].to_list()) == keys
    )
    once = unique_requests(request_keys(units, TEMPLATE, "fp"))
    assert unique_requests(request_keys(units, TEMPLATE, "fp")).equals(once)
    # every unit maps to exactly one of the unique requests
    assert set(
        request_keys(units, TEMPLATE, "fp").filter(pl.col("text") != "")["custom_id"]
    ) == set(once["custom_id"])
