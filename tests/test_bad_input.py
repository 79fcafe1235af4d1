"""Bad input, as a careful user would try it: each case is one line on stderr naming the file,
key, row or variable at fault and what to do, exit code 2, and a state file with no run in it.

`lowtide estimate` reads, chunks and dedupes exactly as a run does but sends nothing, so it meets
every one of these where a run would. The table of inputs and the messages users saw is written
to docs/reliability.md (paths shown relative to the case's folder)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from lowtide.cli import app
from tests.conftest import REPO

runner = CliRunner()

SCHEMA = (
    '{"type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b"]}, '
    '"note": {"type": "string"}}, "required": ["label", "note"], "additionalProperties": false}'
)
INPUT = "id,body,channel,score\n001,hello there,chat,3\n002,good day,email,4\n"
PRICES = (
    "provider,model,effective_date,input_usd_per_mtok,cached_input_usd_per_mtok,"
    "output_usd_per_mtok,batch_discount,source\n"
    "openai,m,2026-01-01,0.15,0.075,0.60,0.5,test\n"
    "emulator,m,2026-01-01,0.15,0.075,0.60,0.5,test\n"
)
JOB = """name = "t"
[input]
path = "in.csv"
id_column = "id"
text_column = "body"
columns = ["channel", "score"]
[output]
schema_file = "schema.json"
[model]
name = "m"
[cost]
price_table = "prices.csv"
"""

Setup = Callable[[Path], None]


def _job(old: str, new: str) -> Setup:
    return lambda d: (d / "job.toml").write_text(JOB.replace(old, new, 1))


def _file(name: str, content: str | bytes) -> Setup:
    def write(d: Path) -> None:
        target = d / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)

    return write


def _schema(text: str) -> Setup:
    return _file("schema.json", text)


def _env(name: str, value: str) -> Setup:
    def setenv(d: Path) -> None:
        os.environ[name] = value.replace("{dir}", str(d))

    return setenv


def _mkdir(name: str) -> Setup:
    return lambda d: (d / name).mkdir()


# (what the user did, how to do it, what the one line must say: a regex)
CASES: list[tuple[str, list[Setup], str]] = [
    ("job file does not exist", [lambda d: (d / "job.toml").unlink()], r"job\.toml: job file not found"),
    ("job file is not UTF-8", [_file("job.toml", b"\xff\xfename = 1")], r"job\.toml: is not UTF-8 text \(byte 0"),
    ("job file is not TOML", [_job('name = "t"', "name = [")], r"job\.toml: not valid TOML"),
    ("misspelt key", [_job('name = "m"', 'name = "m"\ntemprature = 0')], r"\[model\.temprature\] unknown key"),
    ("required key missing", [_job('id_column = "id"\n', "")], r"\[input\.id_column\] required key is missing"),
    ("job name with spaces", [_job('name = "t"', 'name = "My Job"')], r"\[name\] name must be lowercase"),
    ("job named like a lowtide table", [_job('name = "t"', 'name = "runs"')], r"\[name\] a job named 'runs' would publish its view as 'runs', which is one of lowtide's own tables"),
    ("unknown backend", [_job('name = "m"', 'backend = "openai-batch"\nname = "m"')], r"\[model\] backend: unknown backend 'openai-batch'; known: emulator"),
    ("template with an unbalanced brace", [_job("[model]", '[prompt]\nuser_template = "{text} {oops"\n[model]')], r"\[prompt\.user_template\] user_template is not a valid template \(expected '\}' before end of string\); write a literal brace as \{\{ or \}\}"),
    ("template without {text}", [_job("[model]", '[prompt]\nuser_template = "hi"\n[model]')], r"user_template must contain \{text\}"),
    ("template names a column not kept", [_job("[model]", '[prompt]\nuser_template = "{tier} {text}"\n[model]')], r"uses \['tier'\] which are not in \[input\] columns; add them to columns"),
    ("extra_body overrides the model", [_job('name = "m"', 'name = "m"\nextra_body = {model = "gpt-4o"}')], r"\[model\.extra_body\] extra_body may not set \['model'\]"),
    ("extra_body carries messages", [_job('name = "m"', 'name = "m"\nextra_body = {messages = []}')], r"extra_body may not set \['messages'\]"),
    ("schema file missing", [lambda d: (d / "schema.json").unlink()], r"\[output\.schema_file\] .*schema\.json does not exist"),
    ("schema file is not JSON", [_schema("{nope")], r"\[output\.schema_file\] .*schema\.json is not JSON"),
    ("schema is a JSON array", [_schema("[1, 2]")], r"\[output\.schema_file\] schema\.json must be a JSON object schema with properties"),
    ("schema with an unknown type", [_schema('{"type":"object","properties":{"a":{"type":"strng"}}}')], r"schema\.json is not a valid JSON Schema: \"strng\" is not valid"),
    ("schema with a dangling $ref", [_schema('{"type":"object","properties":{"a":{"$ref":"#/$defs/x"}}}')], r"schema\.json is not a valid JSON Schema: Pointer '/\$defs/x' does not exist"),
    ("output field named status", [_schema('{"type":"object","properties":{"status":{"type":"string"}}}')], r"\[output\] schema property 'status' clashes with lowtide's own view column"),
    ("output field with an empty name", [_schema('{"type":"object","properties":{"":{"type":"string"}}}')], r"\[output\] schema has a property with an empty name"),
    ("input column named run_id", [_job('columns = ["channel", "score"]', 'columns = ["run_id"]')], r"\[input\] column name\(s\) \['run_id'\] are lowtide's own view columns"),
    ("reduce rule for a missing field", [_job('schema_file = "schema.json"', 'schema_file = "schema.json"\nreduce = {labels = "first"}')], r"\[output\.reduce\] 'labels' is not a field of the output schema"),
    ("reduce rule of the wrong type", [_job('schema_file = "schema.json"', 'schema_file = "schema.json"\nreduce = {note = "mean"}')], r"\[output\.reduce\] note = 'mean' needs a field of type integer or number; note is string"),
    ("unknown tokenizer encoding", [_job("[model]", '[chunk]\nencoding = "o300k"\n[model]')], r"\[chunk\] encoding 'o300k' is unknown; use one of"),
    ("failed share written as a percentage", [_job("[model]", '[qa]\nmax_failed_share = "5%"\n[model]')], r"\[qa\.max_failed_share\] max_failed_share must be a number from 0 to 1, the share of rows that may fail before the run is held \(0\.05 is 5%\), not '5%'$"),
    ("failed share above 1", [_job("[model]", "[qa]\nmax_failed_share = 5\n[model]")], r"\[qa\.max_failed_share\] max_failed_share must be a number from 0 to 1.*not 5$"),
    ("failed share not a number (nan)", [_job("[model]", "[qa]\nmax_failed_share = nan\n[model]")], r"\[qa\.max_failed_share\] max_failed_share must be a number from 0 to 1.*not nan$"),
    ("overlap as large as the budget", [_job("[model]", "[chunk]\nmax_tokens = 100\noverlap_tokens = 60\n[model]")], r"overlap_tokens must be less than half of max_tokens"),
    ("unknown column type", [_job('columns = ["channel", "score"]', 'columns = {score = "float64"}')], r"\[input\.columns\] .*unknown column type\(s\) \{'score': 'float64'\}"),
    ("input file missing", [lambda d: (d / "in.csv").unlink()], r"in\.csv: input file not found"),
    ("input of an unknown type", [_job('path = "in.csv"', 'path = "in.xlsx"'), _file("in.xlsx", "x")], r"in\.xlsx: unsupported input type '\.xlsx'; use csv, parquet, jsonl or duckdb:TABLE"),
    ("input lacks a column", [_file("in.csv", "id,text\n1,a\n")], r"in\.csv: missing column\(s\) \['body', 'channel', 'score'\]; the file has \['id', 'text'\]"),
    ("input with only a header", [_file("in.csv", "id,body,channel,score\n")], r"in\.csv: the input has no rows \(only a header\?\); nothing to enrich"),
    ("eval set with only a header", [_job("[model]", '[qa]\neval_set = "eval.csv"\n[model]'), _file("eval.csv", "eval_id,body,label\n")], r"eval\.csv: the eval set has no rows \(only a header\?\); add gold rows or remove \[qa\] eval_set"),
    ("duplicate ids", [_file("in.csv", "id,body,channel,score\n7,a,c,1\n7,b,c,1\n")], r"in\.csv: 1 duplicate value\(s\) in id column 'id', e\.g\. \['7'\]; ids must be unique"),
    ("a CSV line with a field too many", [_file("in.csv", "id,body,channel,score,extra\n1,a,c,1,x\n2,hello, world,c,1,x\n")], r"in\.csv: cannot read as csv: .*found more fields than defined"),
    ("a CSV line with a field too many, before the id", [_file("in.csv", "body,id,channel,score\na,1,c,1\nhello, world,2,c,1\nhey, world,3,c,1\n")], r"in\.csv: cannot read as csv: found more fields than defined in 'Schema'$"),
    ("a row without an id", [_file("in.csv", "id,body,channel,score\n1,a,c,1\n,b,c,1\n")], r"in\.csv: 1 row\(s\) have no 'id' \(first at data row\(s\) \[3\]\); every row needs an id"),
    ("a value that is not its declared type", [_job('columns = ["channel", "score"]', 'columns = {channel = "string", score = "integer"}'), _file("in.csv", "id,body,channel,score\n1,a,c,1\n2,b,c,lots\n")], r"in\.csv: column 'score' at data row 3 holds 'lots', which does not convert to integer"),
    ("a negative price", [_file("prices.csv", PRICES.replace("0.60,0.5,test\nemulator", "-0.60,0.5,test\nemulator"))], r"prices\.csv: line 2 \(openai, m\): a price is missing or negative; fix that row"),
    ("a batch discount of 7", [_file("prices.csv", PRICES.replace("0.60,0.5,test\nemulator", "0.60,7,test\nemulator"))], r"prices\.csv: line 2 \(openai, m\): batch_discount 7\.0 is above 1"),
    ("a price table of random bytes", [_file("prices.csv", bytes(range(256)) * 4)], r"prices\.csv: not a readable price table"),
    ("LOWTIDE_SHARD_MAX_REQUESTS=abc", [_env("LOWTIDE_SHARD_MAX_REQUESTS", "abc")], r"^error: LOWTIDE_SHARD_MAX_REQUESTS='abc': Input should be a valid integer"),
    ("LOWTIDE_STATE is a directory", [_mkdir("statedir"), _env("LOWTIDE_STATE", "{dir}/statedir")], r"LOWTIDE_STATE='.*statedir': .*statedir is a directory; give a file path"),
    ("LOWTIDE_WORK_DIR is a file", [_file("work.txt", "x"), _env("LOWTIDE_WORK_DIR", "{dir}/work.txt")], r"LOWTIDE_WORK_DIR='.*work\.txt': .*work\.txt is a file; give a folder path"),
]  # fmt: skip

_SEEN: dict[str, str] = {}


@pytest.mark.parametrize(("what", "setup", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_leaves_no_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, setup: list[Setup], expected: str
) -> None:
    case = tmp_path / "case"
    case.mkdir()
    (case / "job.toml").write_text(JOB)
    (case / "schema.json").write_text(SCHEMA)
    (case / "in.csv").write_text(INPUT)
    (case / "prices.csv").write_text(PRICES)
    monkeypatch.chdir(case)
    saved = dict(os.environ)
    try:
        for step in setup:
            step(case)
        result = runner.invoke(app, ["estimate", "job.toml"], env={"COLUMNS": "80"})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    assert re.search(expected, lines[0]), (expected, lines[0])
    _SEEN[what] = lines[0].replace(str(case), "<dir>").replace(str(tmp_path), "<tmp>")
    state = tmp_path / "state.duckdb"
    if state.is_file():  # nothing sent, so no run either
        con = duckdb.connect(str(state), read_only=True)
        try:
            assert con.execute("SELECT count(*) FROM runs").fetchall() == [(0,)]
        finally:
            con.close()


def test_clean_input_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The base case of the table really is good input: the failures above are the edits."""
    (tmp_path / "job.toml").write_text(JOB)
    (tmp_path / "schema.json").write_text(SCHEMA)
    (tmp_path / "in.csv").write_text(INPUT)
    (tmp_path / "prices.csv").write_text(PRICES)
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["estimate", "job.toml", "--json"])
    assert result.exit_code == 0, result.output
    assert '"rows": 2' in result.stdout


def test_write_the_bad_input_table() -> None:
    """Runs after the cases (file order): the table in docs/reliability.md is what users saw."""
    if len(_SEEN) < len(CASES):
        pytest.skip("the table is written only when every case ran in this session")
    pipe = "\\|"  # a | inside a table cell
    rows = "\n".join(f"| {what} | `{_SEEN[what].replace('|', pipe)}` |" for what, _, _ in CASES)
    section = (
        "<!-- bad-input:start (written by tests/test_bad_input.py) -->\n"
        f"{len(CASES)} cases; each exits 2 with this one line and leaves no run in the state "
        "file (`<dir>` is the job's folder).\n\n"
        f"| input | message |\n|---|---|\n{rows}\n"
        "<!-- bad-input:end -->"
    )
    doc = REPO / "docs" / "reliability.md"
    text = doc.read_text() if doc.is_file() else "# Reliability\n\n## Bad input\n\n"
    if "<!-- bad-input:start" in text:
        text = re.sub(
            r"<!-- bad-input:start.*?<!-- bad-input:end -->", lambda _: section, text, flags=re.S
        )
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    if not doc.is_file() or doc.read_text() != text:
        doc.write_text(text)
