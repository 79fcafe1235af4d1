from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest

from tasks.load import InputError, normalise_input, read_table

FRAME = pl.DataFrame({"id": [1, 2, 3], "body": ["a", "b", None], "channel": ["x", "y", "z"]})


@pytest.mark.parametrize("suffix", ["csv", "parquet", "jsonl", "ndjson"])
def test_reads_every_file_type(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"in.{suffix}"
    {
        "csv": FRAME.write_csv,
        "parquet": FRAME.write_parquet,
        "jsonl": FRAME.write_ndjson,
        "ndjson": FRAME.write_ndjson,
    }[suffix](path)
    out = normalise_input(
        read_table(str(path)),
        where=str(path),
        id_column="id",
        text_column="body",
        columns=["channel"],
    )
    assert out.columns == ["source_id", "text", "channel"]
    assert out["source_id"].to_list() == ["1", "2", "3"]


def test_reads_a_duckdb_table(tmp_path: Path) -> None:
    db = tmp_path / "src.duckdb"
    con = duckdb.connect(str(db))
    con.register("f", FRAME)
    con.execute("CREATE TABLE messages AS SELECT * FROM f")
    con.close()
    assert read_table("duckdb:messages", str(db)).height == 3
    with pytest.raises(InputError, match="no table 'nope'"):
        read_table("duckdb:nope", str(db))


def test_missing_column_names_the_file_and_the_columns(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"in\.csv: missing column\(s\) \['text'\]"):
        normalise_input(
            FRAME, where=str(tmp_path / "in.csv"), id_column="id", text_column="text", columns=[]
        )


def test_null_and_duplicate_ids_are_refused_with_rows() -> None:
    nulls = FRAME.with_columns(pl.Series("id", [1, None, 3]))
    with pytest.raises(
        InputError, match=r"1 row\(s\) have no 'id' \(first at data row\(s\) \[3\]\)"
    ):
        normalise_input(nulls, where="f.csv", id_column="id", text_column="body", columns=[])
    dups = FRAME.with_columns(pl.Series("id", [1, 1, 3]))
    with pytest.raises(InputError, match=r"duplicate value\(s\) in id column 'id', e\.g\. \['1'\]"):
        normalise_input(dups, where="f.csv", id_column="id", text_column="body", columns=[])


def test_unreadable_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="input file not found"):
        read_table(str(tmp_path / "nope.csv"))
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(InputError, match="cannot read as parquet"):
        read_table(str(bad))
    sheet = tmp_path / "in.xlsx"
    sheet.write_text("x")
    with pytest.raises(InputError, match="unsupported input type '.xlsx'"):
        read_table(str(sheet))


def test_ids_are_text_as_written(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("id,body\n00001,a\n007,b\n7,c\n")
    out = normalise_input(
        read_table(str(path), text_columns=("id", "body")),
        where=str(path),
        id_column="id",
        text_column="body",
        columns=[],
    )
    assert out["source_id"].to_list() == ["00001", "007", "7"]


def test_iso_dates_in_a_csv_are_dates_and_columns_take_declared_types(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text(
        "id,body,day,at,score,vip\n"
        "1,a,2026-01-02,2026-01-02T10:11:12,3,yes\n"
        "2,b,2026-01-03,2026-01-03 08:00:00,,no\n"
    )
    out = normalise_input(
        read_table(str(path), text_columns=("id", "body")),
        where=str(path),
        id_column="id",
        text_column="body",
        columns=["day", "at", "score", "vip"],
        column_types={"score": "number", "vip": "boolean", "day": "timestamp"},
    )
    assert out.schema["day"] == pl.Datetime("us")
    assert out.schema["at"].base_type() == pl.Datetime
    assert out["score"].to_list() == [3.0, None]
    assert out["vip"].to_list() == [True, False]


def test_a_value_that_does_not_fit_its_declared_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("id,body,score\n1,a,3\n2,b,lots\n")
    with pytest.raises(
        InputError,
        match=r"in\.csv: column 'score' at data row 3 holds 'lots', which does not convert to ",
    ):
        normalise_input(
            read_table(str(path), text_columns=("id", "body")),
            where=str(path),
            id_column="id",
            text_column="body",
            columns=["score"],
            column_types={"score": "integer"},
        )
