from __future__ import annotations

from pathlib import Path

import pytest

from lowtide.jobspec import JobFileError, load_job
from tests.conftest import SAMPLE_JOB


def test_sample_job_loads_and_resolves_paths() -> None:
    job = load_job(SAMPLE_JOB)
    assert job.view_name == "support_intents"
    assert Path(job.resolve(job.input.path)).is_file()
    assert "intent" in job.enum_fields()
    assert load_job(SAMPLE_JOB, backend="openai").model.backend == "openai"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(text)
    (tmp_path / "schema.json").write_text('{"type":"object","properties":{"a":{"type":"string"}}}')
    return p


BASE = """
name = "t"
[input]
path = "in.csv"
id_column = "id"
text_column = "body"
[output]
schema_file = "schema.json"
[model]
name = "m"
"""


@pytest.mark.parametrize(
    "text,message",
    [
        (
            BASE.replace('name = "m"', 'name = "m"\ntemprature = 1'),
            r"\[model\.temprature\] unknown key",
        ),
        (BASE.replace('id_column = "id"\n', ""), r"\[input\.id_column\] required key is missing"),
        (
            BASE + '[prompt]\nuser_template = "no text here"\n',
            r"user_template must contain \{text\}",
        ),
        (
            BASE + '[prompt]\nuser_template = "{tier}: {text}"\n',
            r"uses \['tier'\] which are not in \[input\] columns",
        ),
        (BASE.replace("schema.json", "nope.json"), r"nope\.json does not exist"),
        (BASE.replace('name = "t"', 'name = "Bad Name"'), "name must be lowercase"),
        ("name = [", "not valid TOML"),
        (
            BASE + "[chunk]\nmax_tokens = 100\noverlap_tokens = 60\n",
            "overlap_tokens must be less than half",
        ),
        (
            BASE.replace('schema.json"', 'schema.json"\nreduce = { b = "first" }'),
            r"\[output\.reduce\] 'b' is not a field of the output schema \['a'\]",
        ),
        (
            BASE.replace('schema.json"', 'schema.json"\nreduce = { a = "mean" }'),
            r"\[output\.reduce\] a = 'mean' needs a field of type integer or number; a is string",
        ),
        (
            BASE.replace('schema.json"', 'schema.json"\nreduce = { a = "vote" }'),
            r"\[output\.reduce\.a\] Input should be 'first'",
        ),
        (
            BASE.replace('text_column = "body"', 'text_column = "body"\ncolumns = ["status"]'),
            r"\[input\] column name\(s\) \['status'\] are lowtide's own view columns",
        ),
        (
            BASE.replace('id_column = "id"', 'id_column = "run_id"'),
            r"\['run_id'\] are lowtide's own view columns",
        ),
        (
            BASE.replace('text_column = "body"', 'text_column = "a"'),
            r"schema property 'a' clashes with an input column of that name",
        ),
        (
            BASE.replace('text_column = "body"', 'text_column = "body"\ncolumns = {at = "time"}'),
            r"unknown column type\(s\) \{'at': 'time'\}",
        ),
    ],
)
def test_bad_job_files_get_clear_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(JobFileError, match=message) as info:
        load_job(_write(tmp_path, text))
    assert str(tmp_path / "job.toml") in str(info.value)


def test_unknown_backend_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(
        JobFileError,
        match="unknown backend 'openai-batch'; known: emulator, openai, anthropic, vllm",
    ):
        load_job(_write(tmp_path, BASE), backend="openai-batch")


def test_a_schema_property_named_like_a_view_column_is_refused(tmp_path: Path) -> None:
    p = _write(tmp_path, BASE)
    (tmp_path / "schema.json").write_text(
        '{"type":"object","properties":{"status":{"type":"string"}}}'
    )
    with pytest.raises(JobFileError, match="property 'status' clashes with lowtide's own view"):
        load_job(p)


def test_reduce_rules_default_per_type_and_follow_the_job_file(tmp_path: Path) -> None:
    p = _write(tmp_path, BASE.replace('schema.json"', 'schema.json"\nreduce = { level = "max" }'))
    (tmp_path / "schema.json").write_text(
        '{"type":"object","properties":{"a":{"type":"string"},'
        '"level":{"type":"string","enum":["low","high"]},"flag":{"type":"boolean"},'
        '"n":{"type":["integer","null"]},"x":{"type":"number"},"tags":{"type":"array"},'
        '"o":{"type":"object"},"label":{"enum":["p","q"]}}}'
    )
    assert load_job(p).reduce_rules() == {
        "a": "concat",
        "level": "max",
        "flag": "any",
        "n": "max",
        "x": "mean",
        "tags": "union",
        "o": "first",
        "label": "majority",
    }


def test_a_pool_key_in_the_job_file_is_deprecated_with_the_way_out(tmp_path: Path) -> None:
    from tests.integration.conftest import write_job

    job = write_job(tmp_path, rows=5, eval_rows=5, extra='[pool]\napi_key = "k-in-file"\n')
    with pytest.warns(FutureWarning, match=r"LOWTIDE_VLLM_API_KEY.*api_key_block") as seen:
        spec = load_job(job)
    assert str(job) in str(seen[0].message) and "k-in-file" not in str(seen[0].message)
    assert spec.pool.api_key == "k-in-file"  # still honoured while deprecated


def test_provider_keep_files_is_read_checked_and_no_change_of_the_job(tmp_path: Path) -> None:
    from lowtide.input_identity import spec_digest

    plain = load_job(_write(tmp_path, BASE))
    assert plain.provider.keep_files is False
    kept = load_job(_write(tmp_path, BASE + "[provider]\nkeep_files = true\n"))
    assert kept.provider.keep_files is True
    # whether the provider keeps the files changes no answer: an unchanged night stays one
    assert spec_digest(kept) == spec_digest(plain)
    with pytest.raises(JobFileError, match=r"\[provider\.keep\] unknown key"):
        load_job(_write(tmp_path, BASE + "[provider]\nkeep = true\n"))
    with pytest.raises(JobFileError, match=r"\[provider\.keep_files\] Input should be a valid"):
        load_job(_write(tmp_path, BASE + '[provider]\nkeep_files = "sometimes"\n'))
