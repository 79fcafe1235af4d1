"""DuckDB keeps what it reads and writes of the state file cached up to a cap that grows with
the rows its key indexes must hold (they cannot spill); LOWTIDE_STATE_MEMORY_MB overrides it,
and running out of it is a clear error that leaves nothing half-written."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import polars as pl
import pytest

from lowtide.errors import PublishError, SettingsError, StateMemoryError
from lowtide.store import Store, memory, publish
from tests.sql import scalar
from tests.store.test_insert_slices import _manifest
from tests.store.test_publish import _seed


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


def _failures(n: int) -> pl.DataFrame:
    """`n` rows of a run's failures (a keyed table), each of its own input row."""
    return pl.select(pl.int_range(n).alias("i")).select(
        ("s" + pl.col("i").cast(pl.String)).alias("source_id"),
        pl.lit("row").alias("kind"),
        pl.lit(None, pl.String).alias("unit_id"),
        pl.lit("parse_failed").alias("reason"),
        pl.lit(None, pl.String).alias("detail"),
    )


def _cuts(n: int) -> pl.DataFrame:
    """`n` remembered chunk cuts, each of its own text."""
    return pl.select(pl.int_range(n).alias("i")).select(
        ("m" + pl.col("i").cast(pl.String)).alias("text_key"),
        pl.lit([0], pl.List(pl.Int32)).alias("starts"),
        pl.lit([1], pl.List(pl.Int32)).alias("lengths"),
        pl.lit([1], pl.List(pl.Int32)).alias("tokens"),
    )


def _cap_mib_of(said: str) -> float:
    number, unit = said.split()
    return float(number) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024, "TiB": 1024**2}[unit]


def _cap_mib(store: Store) -> float:
    """The cap DuckDB applies while the store's file is attached, in MiB."""
    return _cap_mib_of(store._scalar("SELECT current_setting('memory_limit')"))


def _threads(store: Store) -> int:
    return int(store._scalar("SELECT current_setting('threads')"))


def _duckdb_default() -> str:
    return duckdb.connect().execute("SELECT current_setting('memory_limit')").fetchall()[0][0]


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts that keep a cap under 1 GiB, which DuckDB shows in MiB (GiB get one decimal)."""
    monkeypatch.setattr(memory, "BASE_MB", 0)
    monkeypatch.setattr(memory, "PER_THREAD_MB", 8)


def test_the_cap_starts_at_the_base_and_grows_with_keyed_rows(
    tmp_path: Path, small_parts: None
) -> None:
    store = Store(tmp_path / "state.duckdb")
    threads = _threads(store)
    assert _cap_mib(store) == memory.PER_THREAD_MB * threads
    # requests, batch members, units and results are kept unique by lowtide (migration 16),
    # and so are remembered cuts (migration 19); a run's failures are keyed
    store.replace_rows("failures", "r1", _failures(100_000))
    _manifest(store, "r1", _requests(100_000))  # adds nothing keyed
    store.remember_chunk_cuts("v1:budget", _cuts(100_000), "v1")  # nor this
    keyed = scalar(store, "SELECT count(*) FROM failures")
    assert keyed == 100_000
    # the next attach sees the grown file and counts again (whole MiB; DuckDB's statistics
    # may round)
    expected = memory.PER_THREAD_MB * threads + keyed * memory.BYTES_PER_KEYED_ROW / 2**20
    assert _cap_mib(store) == pytest.approx(expected, abs=1)


def test_the_cap_never_exceeds_duckdbs_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "BYTES_PER_KEYED_ROW", 2**40)  # any keyed row would ask a TiB
    store = Store(tmp_path / "state.duckdb")
    _manifest(store, "r1", _requests(10))
    assert _cap_mib(store) == pytest.approx(_cap_mib_of(_duckdb_default()), rel=0.01)


def test_the_variable_overrides_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "300")
    assert _cap_mib(Store(tmp_path / "fixed.duckdb")) == 300
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "0")  # DuckDB's own default
    store = Store(tmp_path / "default.duckdb")
    assert store._scalar("SELECT current_setting('memory_limit')") == _duckdb_default()


def test_running_out_names_the_variable_and_keeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "8")
    store = Store(tmp_path / "state.duckdb")
    # a key index cannot spill: 200,000 failures do not fit in 8 MiB (a manifest of as many
    # requests now does, its tables carry no key)
    with pytest.raises(StateMemoryError) as caught:
        store.replace_rows("failures", "r1", _failures(200_000))
    said = str(caught.value)
    assert str(tmp_path / "state.duckdb") in said
    assert "(8 MiB, from LOWTIDE_STATE_MEMORY_MB)" in said and "rolled back" in said
    assert scalar(store, "SELECT count(*) FROM failures") == 0


def test_a_big_insert_makes_room_for_its_keys_first(tmp_path: Path, small_parts: None) -> None:
    store = Store(tmp_path / "state.duckdb")
    threads = _threads(store)
    with store._transaction() as con:
        store._make_room(con, 500_000)
        inside = con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
    expected = memory.PER_THREAD_MB * threads + 500_000 * memory.BYTES_PER_KEYED_ROW / 2**20
    assert _cap_mib_of(inside) == pytest.approx(expected, abs=1)


def test_a_bad_unrelated_setting_does_not_stop_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_LOCK_TIMEOUT_S", "soon")  # the CLI refuses it; the store reads on
    assert Store(tmp_path / "state.duckdb").list_runs() is not None


def test_a_cap_below_zero_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "-5")
    with pytest.raises(SettingsError, match="LOWTIDE_STATE_MEMORY_MB"):
        Store(tmp_path / "state.duckdb").list_runs()


def test_publishing_past_the_cap_fails_cleanly_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table-by-table path, which runs in the state file's capped DuckDB (a plain copy of
    the file makes its views in the copy's own instance, outside the cap): it is taken when
    the copy might not be one state of the file and there is no previous file to patch."""
    built = Store(tmp_path / "built.duckdb")  # under the sized cap
    _seed(built, "run1", "first")
    shutil.copy(built.path, tmp_path / "state.duckdb")
    monkeypatch.setenv("LOWTIDE_STATE_MEMORY_MB", "1")  # read by the copy's new instance
    monkeypatch.setattr(publish, "copy_at_checkpoint", lambda *args, **kwargs: False)
    store = Store(tmp_path / "state.duckdb")
    with pytest.raises(PublishError, match="LOWTIDE_STATE_MEMORY_MB") as caught:
        store.publish(tmp_path / "pub.duckdb")
    assert isinstance(caught.value.__cause__, StateMemoryError)
    assert not (tmp_path / "pub.duckdb").exists()
    assert not list(tmp_path.glob(".pub.duckdb.*"))  # no temp file left behind
