"""The sample data under data/ is reproducible and has the shape the rest of lowtide relies on:
unique ids, a known share of duplicates and long messages, a disjoint eval set, a strict-mode
schema, a usable price table and a job file whose paths and template fit the data."""

from __future__ import annotations

import importlib.util
import json
import re
import string
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import jsonschema
import polars as pl
import pytest

from lowtide.tokens import count_tokens

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
GENERATED = [
    "support/messages.csv",
    "support/labels.csv",
    "support/eval.csv",
    "schemas/support-intent.json",
    "prices.csv",
    "jobs/support-intents.toml",
]


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_sample", DATA / "make_sample.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(relative: str) -> pl.DataFrame:
    return pl.read_csv(DATA / relative, infer_schema=False)


@pytest.fixture(scope="module")
def messages() -> pl.DataFrame:
    return _read("support/messages.csv")


@pytest.fixture(scope="module")
def labels() -> pl.DataFrame:
    return _read("support/labels.csv")


@pytest.fixture(scope="module")
def evals() -> pl.DataFrame:
    return _read("support/eval.csv")


@pytest.fixture(scope="module")
def job() -> dict:
    with open(DATA / "jobs/support-intents.toml", "rb") as f:
        return tomllib.load(f)


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((DATA / "schemas/support-intent.json").read_text(encoding="utf-8"))


def test_generator_is_deterministic_and_the_committed_files_are_current(tmp_path):
    for out in ("a", "b"):
        subprocess.run(
            [sys.executable, str(DATA / "make_sample.py"), "--out", str(tmp_path / out)],
            check=True,
            capture_output=True,
        )
    for relative in GENERATED:
        first = (tmp_path / "a" / relative).read_bytes()
        assert first == (tmp_path / "b" / relative).read_bytes(), relative
        assert first == (DATA / relative).read_bytes(), (
            f"data/{relative} differs from what data/make_sample.py writes; rerun it and commit"
        )


def test_messages_have_the_documented_columns_and_unique_ids(messages):
    assert messages.columns == ["message_id", "channel", "customer_tier", "received_at", "body"]
    assert 2800 <= messages.height <= 3200
    assert messages.null_count().row(0) == (0, 0, 0, 0, 0)
    ids = messages["message_id"]
    assert ids.n_unique() == messages.height
    assert all(re.fullmatch(r"m\d{6}", i) for i in ids)
    assert set(messages["channel"]) == {"email", "chat", "web_form", "app_review"}
    assert set(messages["customer_tier"]) == {"free", "plus", "business"}
    assert all(re.fullmatch(r"2026-\d\d-\d\d", d) for d in messages["received_at"])


def test_every_message_has_exactly_one_valid_label(gen, messages, labels):
    assert labels.columns == ["message_id", "intent", "urgency"]
    assert labels["message_id"].to_list() == messages["message_id"].to_list()
    assert set(labels["intent"]) == set(gen.INTENTS)
    assert set(labels["urgency"]) == set(gen.URGENCIES)


def test_csv_bodies_read_back_identically_with_the_stdlib(messages):
    import csv

    with open(DATA / "support/messages.csv", newline="", encoding="utf-8") as f:
        bodies = [row["body"] for row in csv.DictReader(f)]
    assert bodies == messages["body"].to_list()


def test_duplicates_have_the_intended_shares_and_share_their_labels(gen, messages, labels):
    bodies = messages["body"].to_list()
    exact = len(bodies) - len(set(bodies))
    near = len(set(bodies)) - len({gen.normalized(b) for b in bodies})
    assert 0.04 <= exact / len(bodies) <= 0.06
    assert 0.015 <= near / len(bodies) <= 0.025
    truth: dict[str, tuple[str, str]] = {}
    for body, intent, urgency in zip(bodies, labels["intent"], labels["urgency"], strict=True):
        key = gen.normalized(body)
        assert truth.setdefault(key, (intent, urgency)) == (intent, urgency)


def test_lengths_have_a_long_tail(messages):
    bodies = messages["body"].to_list()
    words = [len(b.split()) for b in bodies]
    tokens = [count_tokens(b) for b in bodies]
    n = len(bodies)
    assert sorted(words)[n // 2] < 60, "most messages are a few sentences"
    assert 0.06 <= sum(300 <= w <= 1000 for w in words) / n <= 0.10
    assert 0.005 <= sum(t >= 3000 for t in tokens) / n <= 0.02
    assert max(tokens) <= 6000
    assert sum(t > 1024 for t in tokens) > 0.02 * n, "chunking at 1,024 tokens must matter"


def test_text_is_not_plain_ascii(messages):
    text = "".join(messages["body"])
    for needle in ("José", "Zoë", "€"):
        assert needle in text
    assert any(ord(ch) > 0x1F000 for ch in text), "a few emoji"


def test_eval_set_is_gold_labelled_short_and_disjoint_from_messages(gen, messages, evals):
    assert evals.columns == ["eval_id", "channel", "customer_tier", "body", "intent", "urgency"]
    assert 150 <= evals.height <= 250
    assert evals["eval_id"].n_unique() == evals.height
    assert evals.null_count().row(0) == (0,) * 6
    assert set(evals["intent"]) == set(gen.INTENTS)
    assert set(evals["urgency"]) <= set(gen.URGENCIES)
    assert not set(evals["eval_id"]) & set(messages["message_id"])
    seen = {gen.normalized(b) for b in messages["body"]}
    assert not seen & {gen.normalized(b) for b in evals["body"]}
    assert max(count_tokens(b) for b in evals["body"]) < 1024


def _assert_strict(node: dict, where: str = "$") -> None:
    if node.get("type") == "object":
        assert node.get("additionalProperties") is False, where
        assert sorted(node.get("required", [])) == sorted(node["properties"]), where
    for key, child in node.get("properties", {}).items():
        _assert_strict(child, f"{where}.{key}")
    if isinstance(node.get("items"), dict):
        _assert_strict(node["items"], f"{where}[]")


def test_schema_is_strict_mode_compatible(gen, schema):
    jsonschema.Draft202012Validator.check_schema(schema)
    _assert_strict(schema)
    props = schema["properties"]
    assert props["intent"]["enum"] == list(gen.INTENTS)
    assert props["urgency"]["enum"] == ["low", "normal", "urgent"]
    assert props["summary"] == {**props["summary"], "type": "string", "maxLength": 200}
    validator = jsonschema.Draft202012Validator(schema)
    good = {"intent": "complaint", "urgency": "low", "summary": "Unhappy with the chat agent."}
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "extra": 1})
    assert not validator.is_valid({**good, "summary": "x" * 201})


def test_price_table_parses_with_positive_prices(job):
    prices = pl.read_csv(DATA / "prices.csv")
    assert prices.columns == [
        "provider",
        "model",
        "effective_date",
        "input_usd_per_mtok",
        "cached_input_usd_per_mtok",
        "output_usd_per_mtok",
        "batch_discount",
        "source",
    ]
    assert prices.null_count().row(0) == (0,) * 8
    for column in ("input_usd_per_mtok", "cached_input_usd_per_mtok", "output_usd_per_mtok"):
        assert prices[column].dtype == pl.Float64 and (prices[column] > 0).all(), column
    assert (prices["cached_input_usd_per_mtok"] <= prices["input_usd_per_mtok"]).all()
    assert prices["batch_discount"].is_between(0, 1, closed="right").all()
    keys = prices.select("provider", "model", "effective_date")
    assert keys.n_unique() == prices.height
    assert not any("://" in s for s in prices["source"])
    model = job["model"]
    assert (model["backend"], model["name"]) in set(prices.select("provider", "model").iter_rows())


def test_emulator_prices_are_its_own_and_mirror_the_model_they_stand_for():
    """A job run on the emulator is priced as the real model it stands in for (the emulator's
    claude-haiku-4-5 row once carried gpt-4o-mini's prices), in rows labelled as the emulator's."""
    from lowtide.pricing import load_price

    prices = pl.read_csv(DATA / "prices.csv", schema_overrides={"effective_date": pl.String})
    emulated = prices.filter(pl.col("provider") == "emulator")
    real = prices.filter(pl.col("provider") != "emulator")
    numbers = ["input_usd_per_mtok", "cached_input_usd_per_mtok", "output_usd_per_mtok"]
    joined = emulated.join(real, on=["model", "effective_date"], suffix="_real")
    assert joined.height == emulated.height == real.height  # one per real model, no orphan
    for column in [*numbers, "batch_discount"]:
        assert (joined[column] == joined[f"{column}_real"]).all(), column
    assert all(source.startswith("lowtide emulator prices") for source in emulated["source"])
    for provider, model in real.select("provider", "model").iter_rows():
        on_emulator = load_price(DATA / "prices.csv", "emulator", model)
        assert on_emulator.provider == "emulator"
        assert (on_emulator.input, on_emulator.output) == (
            load_price(DATA / "prices.csv", provider, model).input,
            load_price(DATA / "prices.csv", provider, model).output,
        )


def test_job_file_fits_the_data(gen, job, schema, messages):
    folder = DATA / "jobs"
    for path in (
        job["input"]["path"],
        job["output"]["schema_file"],
        job["qa"]["eval_set"],
        job["cost"]["price_table"],
    ):
        assert (folder / path).is_file(), path
    columns = {job["input"]["id_column"], job["input"]["text_column"], *job["input"]["columns"]}
    assert columns <= set(messages.columns)
    template = job["prompt"]["user_template"]
    assert template == gen.USER_TEMPLATE
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    assert fields <= {"text", *job["input"]["columns"]} and "text" in fields
    fixed = string.Formatter().parse(template)
    fixed_text = " ".join(literal for literal, *_ in fixed)
    every_label = [*gen.INTENTS, *gen.URGENCIES]
    assert not any(gen.label_scores(fixed_text, every_label).values())
    assert 250 <= len(job["prompt"]["system"].split()) <= 400
    validator = jsonschema.Draft202012Validator(schema)
    assert 2 <= len(job["prompt"]["examples"]) <= 3
    for example in job["prompt"]["examples"]:
        assert example["user"].startswith("Channel: ")
        assert validator.is_valid(json.loads(example["assistant"]))
    assert job["chunk"] == {
        "mode": "split",
        "max_tokens": 1024,
        "overlap_tokens": 64,
        "encoding": "o200k_base",
    }


def test_neutral_phrase_banks_carry_no_label_keyword(gen):
    assert gen.neutral_bank_hits() == []


def test_only_urgent_messages_say_urgent(gen, messages, labels):
    for body, urgency in zip(messages["body"], labels["urgency"], strict=True):
        if urgency != "urgent":
            assert not gen.label_scores(body, ["urgent"])["urgent"], body


def test_cue_rule_scores_between_useless_and_perfect(gen, evals):
    rows = list(evals.select("channel", "body", "intent", "urgency").iter_rows())
    intent = [
        gen.rule_credit(gen.rendered_user_message(c, b), gen.INTENTS, i) for c, b, i, _ in rows
    ]
    urgency = [
        gen.rule_credit(gen.rendered_user_message(c, b), gen.URGENCIES, u) for c, b, _, u in rows
    ]
    assert 0.65 <= sum(intent) / len(rows) <= 0.88
    assert 0.35 <= sum(urgency) / len(rows) <= 0.7
