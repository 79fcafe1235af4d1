from __future__ import annotations

import re
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.backends import EMULATOR_ENGINE, backend_entry
from lowtide.jobspec import load_job
from lowtide.slices import FileWriter
from tasks import dedupe
from tasks.dedupe import key_units, request_keys, unique_requests
from tests.conftest import SAMPLE_JOB

TEMPLATE = "Channel: {channel}\n\n{text}"
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _units(
    texts: list[str], channels: list[str] | None = None, sources: list[str] | None = None
) -> pl.DataFrame:
    n = len(texts)
    sources = sources or [f"r{i}" for i in range(n)]
    return pl.DataFrame(
        {
            "unit_id": [f"{source}#0" for source in sources],
            "source_id": sources,
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


@pytest.mark.parametrize("arrow_from", [0, 10**9], ids=["case-through-arrow", "polars-only"])
def test_keys_do_not_change_between_versions(
    monkeypatch: pytest.MonkeyPatch, arrow_from: int
) -> None:
    """Stored answers are found by these keys: a change to how messages are folded or hashed
    would make every stored answer a miss (and paid for again) unless CUSTOM_ID_VERSION says
    so. Runs of mixed whitespace, a lone Unicode space, CJK and controls. Long columns fold
    their case through Arrow (`lowtide.lowercase`): where Arrow and polars disagree (a
    word-final capital sigma, İ) the key stays polars' own."""
    from lowtide import lowercase

    texts = [
        "Refund  please",
        " A\t\tb \n\n c\u00a0 d\u2003\u2003e ",
        "x\r\ny\x0bz\x0c",
        "ünï 数据  ok",
        "\u00a0lone nbsp\u00a0",
        "ΟΔΥΣΣΕΥΣ İstanbul",
    ]
    monkeypatch.setattr(lowercase, "FAST_FROM_ROWS", arrow_from)
    keyed = request_keys(_units(texts), TEMPLATE, "fp@emulator")
    assert keyed["custom_id"].to_list() == [
        "lt2_3714e8aaa2f1217cee797d4c08f084ea5559350be7495449",
        "lt2_6cdc9573b6a92623d25a16333a755561d99ae4e5fee17b26",
        "lt2_c43dad3379bb4411cce9bbba0bdbb6318e79360098a669c0",
        "lt2_955386d5f3a8a687df0fe87862d0cdc31770cc8acfac718e",
        "lt2_d234aad10f2129430ad4de48104a0b8b30fe1477a3462c4d",
        "lt2_0ab262f19fcde4f4a69a4ca1b4ff14050f798a374f57788c",  # stored before Arrow folded
    ]


def test_keys_made_a_slice_at_a_time_are_the_keys_of_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    units = _units(
        ["Hello", "hello ", "Other", None, "ünï 数据", "x" * 500, "Hello"],
        channels=["email", "email", "chat", "chat", None, "email", "chat"],
    )
    whole = request_keys(units, TEMPLATE, "fp")
    monkeypatch.setattr(dedupe, "_SLICE_ROWS", 2)
    assert request_keys(units, TEMPLATE, "fp").equals(whole)
    assert whole["custom_id"][0] == whole["custom_id"][1] != whole["custom_id"][6]


def test_template_columns_and_prompt_are_part_of_the_key() -> None:
    a = request_keys(_units(["same"], ["email"]), TEMPLATE, "fp")["custom_id"][0]
    b = request_keys(_units(["same"], ["chat"]), TEMPLATE, "fp")["custom_id"][0]
    c = request_keys(_units(["same"], ["email"]), TEMPLATE, "other-fp")["custom_id"][0]
    assert len({a, b, c}) == 3


def test_custom_ids_fit_both_providers_and_are_versioned() -> None:
    ids = request_keys(_units(["x", "y"]), TEMPLATE, "fp")["custom_id"].to_list()
    assert all(CUSTOM_ID.match(i) and i.startswith("lt2_") for i in ids)


def _keys(backend: str, model: str | None = None) -> list[str]:
    job = load_job(SAMPLE_JOB, backend)
    if model is not None:
        job.model.name = model
    return key_units(job, _units(["refund please", "where is my parcel"]), "run-1")[
        "custom_id"
    ].to_list()


def test_answers_are_shared_only_within_one_engine_family_and_model() -> None:
    """The emulator's invented answers never become a real backend's cache hits; real engines
    share answers only when they are the same provider family running the same model id."""
    openai = _keys("openai")
    assert _keys("openai") == openai  # a second run on the same engine: the same keys
    assert load_job(SAMPLE_JOB, "emulator").model.name == load_job(SAMPLE_JOB, "openai").model.name
    emulated = _keys("emulator")
    assert not set(emulated) & set(openai)  # same model id, but the emulator's answers
    assert not set(_keys("anthropic", "gpt-4o-mini")) & set(openai)
    assert not set(_keys("vllm", "gpt-4o-mini")) & set(openai)  # a pool is another family
    assert not set(_keys("openai", "gpt-4o")) & set(openai)
    assert backend_entry("openai").answer_family("gpt-4o-mini") == "openai:gpt-4o-mini"
    assert backend_entry("vllm").answer_family("m") == "vllm:m"
    assert backend_entry("emulator").answer_family("gpt-4o-mini") == EMULATOR_ENGINE


TEXTS = st.lists(
    st.sampled_from(["a", "A ", "b", " b", "ccc", "Zoë", "zoë", "x  y", "x y"]), max_size=30
)


def _key_of_unit(keyed: pl.DataFrame) -> dict[str, str]:
    return dict(zip(keyed["unit_id"], keyed["custom_id"], strict=True))


def _asked(keyed: pl.DataFrame) -> set[str]:
    return set(unique_requests(keyed)["custom_id"])


@given(
    texts=TEXTS,
    copies=st.lists(st.integers(min_value=0, max_value=29), max_size=30),
    seed=st.randoms(),
)
@settings(max_examples=50, deadline=None)
def test_dedupe_is_order_independent_and_idempotent(texts: list[str], copies, seed) -> None:
    units = _units(texts)
    alone = request_keys(units, TEMPLATE, "fp")
    keys = _asked(alone)
    # identical units (up to case and whitespace) share a request, different ones do not
    fold = {t: " ".join(t.lower().split()) for t in texts}
    by_key: dict[str, set[str]] = {}
    for text, cid in zip(alone["text"], alone["custom_id"], strict=True):
        by_key.setdefault(cid, set()).add(fold[text])
    assert all(len(folded) == 1 for folded in by_key.values())
    assert len(by_key) == len(set(fold.values()))
    # every non-empty unit is asked once, as one of the unique requests; empty ones are not
    assert keys == set(alone.filter(pl.col("text") != "")["custom_id"])
    assert unique_requests(alone)["custom_id"].is_unique().all()

    # Idempotent: the units plus shuffled duplicates of some of them ask nothing new, and each
    # unit keeps the key it had alone (a duplicate gets its original's key).
    picks = [i for i in copies if i < len(texts)]
    dup_of = {f"d{j}#0": f"r{i}#0" for j, i in enumerate(picks)}
    both = _units(
        texts + [texts[i] for i in picks],
        sources=[f"r{i}" for i in range(len(texts))] + [f"d{j}" for j in range(len(picks))],
    ).sample(fraction=1.0, shuffle=True, seed=seed.randint(0, 10**6))
    keyed = request_keys(both, TEMPLATE, "fp")
    assert _asked(keyed) == keys
    alone_keys = _key_of_unit(alone)
    for unit_id, cid in _key_of_unit(keyed).items():
        assert cid == alone_keys[dup_of.get(unit_id, unit_id)]
    # Order-independent: the same units in another order ask the same requests, unit by unit.
    reordered = units.sample(fraction=1.0, shuffle=True, seed=seed.randint(0, 10**6))
    keyed = request_keys(reordered, TEMPLATE, "fp")
    assert _asked(keyed) == keys and _key_of_unit(keyed) == alone_keys


def _messages_file(path: Path) -> Path:
    """Two slices' first units, as `Keyer` writes them: key `a` first in both slices,
    urgent only in the second."""
    out = FileWriter(path)
    for rows, ids, urgent in (
        ([0, 1], ["a", "b"], [False, False]),
        ([3, 4], ["a", "c"], [True, False]),
    ):
        out.write(
            pl.DataFrame(
                {
                    "custom_id": ids,
                    "request_key": ids,
                    "user": [f"message {i}" for i in ids],
                    "unit_tokens": [None, None],
                    "_row": rows,
                    "urgent": urgent,
                },
                schema_overrides={"unit_tokens": pl.Int32, "_row": pl.Int64},
            )
        )
    out.close()
    return path


def test_to_send_is_the_messages_file_itself_only_when_it_holds_exactly_what_is_sent(
    tmp_path: Path,
) -> None:
    every = pl.DataFrame({"_row": [0, 1, 3, 4], "urgent": [False, False, True, False]})
    messages = _messages_file(tmp_path / "messages.parquet")
    assert dedupe.write_to_send(messages, every, tmp_path / "all.parquet") == 4
    assert not messages.exists()  # renamed: nothing copied
    assert pl.read_parquet(tmp_path / "all.parquet")["custom_id"].to_list() == ["a", "b", "a", "c"]

    # what dedupe wants: `a` once (its first row), urgent because a unit sharing it is
    wanted = pl.DataFrame({"_row": [0, 1, 4], "urgent": [True, False, False]})
    messages = _messages_file(tmp_path / "messages.parquet")
    assert dedupe.write_to_send(messages, wanted, tmp_path / "some.parquet") == 3
    sent = pl.read_parquet(tmp_path / "some.parquet")
    assert sent.columns == ["custom_id", "request_key", "user", "unit_tokens", "urgent"]
    assert sent.select("custom_id", "user", "urgent").rows() == [
        ("a", "message a", True),
        ("b", "message b", False),
        ("c", "message c", False),
    ]


def test_an_id_is_first_written_once_across_slices_and_others_pass() -> None:
    written = dedupe.WrittenIds()
    first = pl.DataFrame({"custom_id": ["a", "b"], "_row": [0, 1]})
    assert written.first_time(first)["custom_id"].to_list() == ["a", "b"]
    # a later slice: "b" was written already, "c" and "d" are new
    later = pl.DataFrame({"custom_id": ["c", "b", "d"], "_row": [2, 3, 4]})
    kept = written.first_time(later)
    assert kept.to_dict(as_series=False) == {"custom_id": ["c", "d"], "_row": [2, 4]}
    assert written.first_time(pl.DataFrame({"custom_id": ["d", "a"], "_row": [5, 6]})).is_empty()
    # a slice of nothing new, and an empty slice, change nothing
    assert written.first_time(first.clear()).is_empty()
    assert written.first_time(pl.DataFrame({"custom_id": ["e"], "_row": [7]})).height == 1
