"""DuckDB keeps what it reads and writes of the state file cached up to a cap that grows with
the rows its key indexes must hold (they cannot spill); LOWTIDE_STATE_MEMORY_MB overrides it,
and running out of it is a clear error that leaves nothing half-written."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest

from lowtide.errors import StateMemoryError
from lowtide.store import Store, memory
from tests.sql import scalar
from tests.store.test_insert_slices import _manifest


def _requests(n: int, message: str = "") -> pl.DataFrame:
    return pl.select(pl.int_range(n).alias("i")).select(
        ("c" + pl.col("i").cast(pl.String)).alias("custom_id"),
        ("k" + pl.col("i").cast(pl.String)).alias("request_key"),
        pl.lit("j").alias("job"),
        pl.lit("m").alias("model"),
        pl.col("i").cast(pl.Int32).alias("est_input_tokens"),
        (pl.col("i").cast(pl.String) + pl.lit(message)).alias("user_message"),
        pl.lit("t").alias("template_id"),
    )


def _cap_mib_of(said: str) -> float:
    number, unit = said.split()
    return float(number) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024, "TiB": 1024**2}[unit]


def _cap_mib(store: Store) -> float:
    """The cap DuckDB applies while the store's file is attached, in MiB."""
    return _cap_mib_of(store._scalar("SELECT current_setting('memory_limit')"))


def _threads(store: Store) -> int:
    return int(store._scalar("SELECT current_setting('threads')"))


def test_the_cap_starts_at_the_base_and_grows_with_keyed_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "BASE_MB", 0)  # DuckDB shows GiB with one decimal only
    store = Store(tmp_path / "state.duckdb")
    threads = _threads(store)
    assert _cap_mib(store) == memory.PER_THREAD_MB * threads
    _manifest(store, "r1", _requests(100_000))  # 100k requests and 100k batch members
    keyed = scalar(store, "SELECT (SELECT count(*) FROM requests) + count(*) FROM batch_requests")
    assert keyed == 200_000
    # the next attach sees the grown file and counts again (DuckDB's statistics may round)
    expected = memory.PER_THREAD_MB * threads + keyed * memory.BYTES_PER_KEYED_ROW / 2**20
    assert _cap_mib(store) == pytest.approx(expected, abs=0.5)


def test_the_cap_never_exceeds_duckdbs_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "BYTES_PER_KEYED_ROW", 2**40)  # any keyed row would ask a TiB
    store = Store(tmp_path / "state.duckdb")
    _manifest(store, "r1", _requests(10))
    default = duckdb.connect().execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
    assert _cap_mib(store) == pytest.approx(_cap_mib_of(default), rel=0.01)


def test_the_variable_overrides_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "300")
    assert _cap_mib(Store(tmp_path / "fixed.duckdb")) == 300
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "0")  # DuckDB's own default
    default = duckdb.connect().execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
    store = Store(tmp_path / "default.duckdb")
    assert store._scalar("SELECT current_setting('memory_limit')") == default


def test_running_out_names_the_variable_and_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "8")
    store = Store(tmp_path / "state.duckdb")
    with pytest.raises(StateMemoryError) as caught:
        _manifest(store, "r1", _requests(20_000, message="x" * 20))
    said = str(caught.value)
    assert str(tmp_path / "state.duckdb") in said
    assert "(8 MiB, from LOWTIDE_STATE_MEMORY_MB)" in said and "rolled back" in said
    assert scalar(store, "SELECT count(*) FROM requests") == 0
    assert scalar(store, "SELECT count(*) FROM batches") == 0


def test_a_cap_below_zero_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lowtide.errors import SettingsError

    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "-5")
    with pytest.raises(SettingsError, match="LOWTIDE_STATE_MEMORY_MB"):
        Store(tmp_path / "state.duckdb").list_runs()
