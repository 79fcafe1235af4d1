"""Which earlier run may lend its units to a changed night's unchanged rows: only the run the
job's view shows, made under the same job spec, backend, model and units recipe (column types,
cutting and custom_id recipes), and never a route's step, whose units may carry another
engine's answers."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl

from lowtide.store import Store
from tasks.chunk import units_recipe
from tests.store import runs

RUN = {**runs.RUN, "spec_digest": "s"}
ASK = {
    "backend": "openai",
    "model": "m",
    "job_fingerprint": "f",
    "spec_digest": "s",
    "units_recipe": "u",
}


def _shown_run(store: Store, run_id: str, recipe: str = "u") -> None:
    """A run prepared under `recipe`, completed and published (the one the view shows)."""
    store.open_or_resume_run(run_id=run_id, **RUN)
    store.record_prepared(
        run_id,
        rows=1,
        units=1,
        unique_requests=1,
        cache_hits=0,
        spec_digest="s",
        units_recipe=recipe,
    )
    runs.finish(store, run_id)
    store.mark_published(run_id)


def test_only_the_shown_run_made_the_same_way_lends_its_units(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    assert store.carry_source("j", **ASK) is None  # a first night
    _shown_run(store, "r1")
    assert store.carry_source("j", **ASK) == "r1"
    for key, other in [
        ("units_recipe", "a column read as another type"),
        ("spec_digest", "another job file"),
        ("backend", "anthropic"),
        ("model", "m2"),
        ("job_fingerprint", "another prompt"),
    ]:
        assert store.carry_source("j", **{**ASK, key: other}) is None, key
    assert store.carry_source("another-job", **ASK) is None


def test_a_route_step_never_lends_its_units(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    _shown_run(store, "r1")
    with duckdb.connect(str(tmp_path / "state.duckdb")) as con:
        con.execute("UPDATE runs SET route_id = 'r0', route_step = 1 WHERE run_id = 'r1'")
    assert store.carry_source("j", **ASK) is None


def test_the_units_recipe_sees_column_types_but_not_column_order() -> None:
    ints = pl.Schema({"source_id": pl.String, "text": pl.String, "rating": pl.Int64})
    floats = pl.Schema({"source_id": pl.String, "text": pl.String, "rating": pl.Float64})
    moved = pl.Schema({"rating": pl.Int64, "source_id": pl.String, "text": pl.String})
    utc = pl.Schema({"source_id": pl.String, "at": pl.Datetime("us", "UTC")})
    local = pl.Schema({"source_id": pl.String, "at": pl.Datetime("us")})
    assert units_recipe(ints) != units_recipe(floats)  # `0` and `0.0` render differently
    assert units_recipe(ints) == units_recipe(moved)
    assert units_recipe(utc) != units_recipe(local)
