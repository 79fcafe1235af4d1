"""Errors are one line on stderr, however long the path in them and although the output is not a
terminal (Rich would wrap it at 80 columns), and printed literally: a job file's `[section] key`
keeps its brackets, `:smile:` stays text. `lowtide sql` shows values as stored."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from lowtide.cli import app

runner = CliRunner()


@pytest.fixture
def deep(tmp_path: Path) -> Path:
    """A folder whose path is far longer than any terminal, with markup and an emoji code in it."""
    path = tmp_path / ("a-very-long-folder-name-" * 5) / ("[input]-and-:smile:-" * 5) / ("z" * 60)
    path.mkdir(parents=True)
    assert len(str(path)) > 250
    return path


def _one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0]


def test_a_job_file_error_is_one_line_with_its_brackets(deep: Path) -> None:
    job = deep / "job.toml"
    job.write_text(
        'name = "x"\n[input]\npath = "in.csv"\ntext_column = "t"\n'
        '[output]\nschema = {type = "object", properties = {}}\n[model]\nname = "m"\n'
    )
    result = runner.invoke(app, ["run", str(job)])
    assert result.exit_code == 2
    line = _one_error_line(result.stderr)
    assert line == f"error: {job}: [input.id_column] required key is missing"


def test_an_unknown_backend_names_the_key_in_brackets(deep: Path) -> None:
    job = deep / "job.toml"
    job.write_text(
        'name = "x"\n[input]\npath = "in.csv"\nid_column = "id"\ntext_column = "t"\n'
        '[output]\nschema = {type = "object", properties = {}}\n[model]\nname = "m"\n'
    )
    result = runner.invoke(app, ["run", str(job), "--backend", "nope"])
    assert result.exit_code == 2
    line = _one_error_line(result.stderr)
    assert f"{job}: [model] backend: unknown backend 'nope'; known: emulator" in line


def test_sql_on_a_missing_file_is_one_line(deep: Path) -> None:
    db = deep / "none.duckdb"
    result = runner.invoke(app, ["sql", "SELECT 1", "--db", str(db)])
    assert result.exit_code == 2
    assert _one_error_line(result.stderr) == (
        f"error: {db}: no published file yet; run a job first (lowtide demo)"
    )


def test_bad_sql_is_one_line_although_duckdb_explains_over_several(deep: Path) -> None:
    db = deep / "published.duckdb"
    duckdb.connect(str(db)).close()
    result = runner.invoke(app, ["sql", "SELEC [x] FROM :smile:", "--db", str(db)])
    assert result.exit_code == 2
    line = _one_error_line(result.stderr)
    assert line.startswith(f"error: {db}: Parser Error: syntax error")
    assert "SELEC [x] FROM :smile:" in line


def test_qa_import_of_a_bad_file_is_one_line(deep: Path) -> None:
    review = deep / "review.csv"
    review.write_text("run_id,unit_id\nr,u\n")
    result = runner.invoke(app, ["qa", "import", str(review)])
    assert result.exit_code == 2
    assert _one_error_line(result.stderr) == (
        f"error: {review}: missing column(s) ['correct_value', 'verdict']; import the file "
        "`lowtide qa export` wrote"
    )


def test_a_polars_error_in_qa_import_is_one_line(deep: Path) -> None:
    review = deep / "review.csv"  # Polars explains a ragged row over three lines
    review.write_text("run_id,unit_id,verdict,correct_value\nr,u,x,y,z,w\n")
    result = runner.invoke(app, ["qa", "import", str(review)])
    assert result.exit_code == 2, result.output
    assert _one_error_line(result.stderr) == (
        f"error: {review}: not a readable CSV: found more fields than defined in 'Schema' "
        "Consider setting 'truncate_ragged_lines=True'."
    )


def test_sql_prints_values_and_column_names_literally(tmp_path: Path) -> None:
    db = tmp_path / "published.duckdb"
    con = duckdb.connect(str(db))
    con.execute('CREATE TABLE t ("[b]" VARCHAR, v VARCHAR)')
    con.execute(
        "INSERT INTO t VALUES ('[bold]loud[/bold]', ':smile:'), ('[red]', 'a [link=x]b[/link]')"
    )
    con.close()
    result = runner.invoke(
        app,
        ["sql", 'SELECT "[b]", v FROM t ORDER BY v DESC', "--db", str(db)],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in ("[b]", "[bold]loud[/bold]", ":smile:", "[red]", "a [link=x]b[/link]"):
        assert text in out, (text, out)
    assert "😄" not in out


def test_served_model_names_without_engines_is_refused() -> None:
    result = runner.invoke(app, ["emulator", "--served-model-name", "m", "--port", "0"])
    assert result.exit_code == 2
    assert _one_error_line(result.stderr) == (
        "error: --served-model-name names what the vLLM engines serve; add --engines N"
    )


def test_qa_import_refuses_two_verdicts_for_one_unit(deep: Path) -> None:
    review = deep / "review.csv"
    review.write_text(
        "run_id,unit_id,verdict,correct_value\nr1,m1#0,correct,\nr1,m2#0,correct,\n"
        "r1,m1#0,incorrect,billing\n"
    )
    result = runner.invoke(app, ["qa", "import", str(review)])
    assert result.exit_code == 2, result.output
    assert _one_error_line(result.stderr) == (
        f"error: {review}: rows [2, 4]: unit 'm1#0' of run 'r1' is reviewed more than once; "
        "keep one verdict per unit"
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run"], "error: Missing argument 'job_file'. (see lowtide run --help)"),
        (["status", "--bogus"], "error: No such option: --bogus (see lowtide status --help)"),
        (["qa", "import"], "error: Missing argument 'file'. (see lowtide qa import --help)"),
        (
            ["emulator", "--port", "99999"],
            "error: Invalid value for '--port': Input should be less than or equal to 65535 "
            "(see lowtide emulator --help)",
        ),
        (
            ["emulator", "--port", "0", "--faults", "often"],
            "error: --faults: Unknown fault kind 'often' in 'often'; known: 429, 500, 502, 503, "
            "529, drop, error_rate, malformed_rate, slow_finalizing",
        ),
    ],
)
def test_usage_errors_are_one_line_not_a_box(args: list[str], line: str) -> None:
    result = runner.invoke(app, args, prog_name="lowtide")
    assert result.exit_code == 2, result.output
    assert _one_error_line(result.stderr) == line


@pytest.mark.parametrize(
    ("codes", "code"),
    [([75, 75], 75), ([75, 3], 3), ([3, 2], 2), ([3, 75, 1, 2], 1), ([], 1)],
)
def test_a_group_of_errors_retries_only_when_every_one_says_retry_later(
    codes: list[int], code: int
) -> None:
    """A collect over several runs: one held run beside a 429 must not make a scheduler retry
    (`max()` would have said 75)."""
    from lowtide.errors import worst_exit_code

    assert worst_exit_code(codes) == code
