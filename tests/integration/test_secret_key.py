"""A provider key from a Prefect Secret block: a job naming `[model] api_key_block` runs on the
openai backend with no OPENAI_API_KEY in the environment, and the key reaches none of what a run
leaves behind (the state file, the published file, the work dir, the Prefect artifacts, the
logs); without the block the run stops at once with one line naming both places."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import duckdb
import polars as pl
import pytest
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client

from flows.enrich import enrich
from lowtide.backends import backend_entry
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.errors import CredentialsError
from lowtide.store import Store
from tests.integration.conftest import write_job

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


def _job(tmp_path: Path, block: str) -> Path:
    return write_job(
        tmp_path,
        rows=15,
        eval_rows=3,
        replace={"extra_body = {}\n": f'extra_body = {{}}\napi_key_block = "{block}"\n'},
    )


def _point_openai_at(emu: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    env = backend_entry("openai").emulator_env(emu.base_url)
    env.pop("OPENAI_API_KEY")
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def _database_text(path: Path) -> str:
    """Every value of every table and view of a DuckDB file, as text."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        names = con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'main'"
        ).fetchall()
        assert names
        return "\n".join(
            repr(con.execute(f'SELECT * FROM "{name}"').fetchall()) for (name,) in names
        )
    finally:
        con.close()


def _work_dir_text(path: Path) -> str:
    out = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if file.suffix == ".parquet":  # compressed: read the values, not the bytes
            out.append(repr(pl.read_parquet(file).rows()))
        out.append(file.read_bytes().decode("utf-8", "replace"))
    assert out
    return "\n".join(out)


def test_the_key_comes_from_the_block_and_is_left_nowhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    key = f"sk-test-{uuid.uuid4().hex}"
    block = f"openai-prod-{uuid.uuid4().hex[:8]}"
    Secret(value=key).save(block)
    job = _job(tmp_path, block)
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("LOWTIDE_KEEP_WORK_DIR", "1")  # keep the run's files, to scan them
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        _point_openai_at(emu, monkeypatch)
        s = enrich(job_file=str(job), backend="openai", emulator_url=emu.base_url)
        billed = emu.ledger.count_by_custom_id()
    assert s["status"] == "completed" and s["backend"] == "openai"
    assert s["rows"] == 15 == s["succeeded"]
    assert len(billed) == s["unique_requests"]  # the openai SDK, keyed by the block, sent them

    assert key not in _database_text(Path(os.environ["LOWTIDE_STATE"]))
    assert key not in _database_text(Path(s["db"]))
    work = Path(os.environ["LOWTIDE_WORK_DIR"])
    assert any(work.rglob("*.parquet"))  # there was something to scan
    assert key not in _work_dir_text(work)
    assert key not in repr(s)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts()
    assert artifacts and key not in repr([a.model_dump() for a in artifacts])
    assert key not in caplog.text and key not in repr([r.__dict__ for r in caplog.records])


def test_without_key_or_block_the_run_stops_naming_both_then_the_block_answers_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No key anywhere: one error naming both places, and the run stays resumable, nothing of
    it failed. Once the block is saved, the next run resumes it and answers every row, each
    request executed once (the emulator's ledger)."""
    block = f"openai-missing-{uuid.uuid4().hex[:8]}"
    job = _job(tmp_path, block)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        _point_openai_at(emu, monkeypatch)
        with pytest.raises(CredentialsError, match="set OPENAI_API_KEY or save the key") as e:
            enrich(job_file=str(job), backend="openai", emulator_url=emu.base_url)
        assert emu.ledger.count_by_custom_id() == {}  # nothing was sent
        (stopped,) = Store(os.environ["LOWTIDE_STATE"]).list_runs().to_dicts()
        assert stopped["status"] == "running" and "no such block" in stopped["error"]
        batches = Store(os.environ["LOWTIDE_STATE"]).run_batches(stopped["run_id"])
        assert set(batches["status"]) == {"pending"}  # not failed: the next run sends them

        Secret(value=f"sk-test-{uuid.uuid4().hex}").save(block)
        s = enrich(job_file=str(job), backend="openai", emulator_url=emu.base_url)
        billed = emu.ledger.count_by_custom_id()
    assert f"Prefect Secret block {block!r}: no such block" in str(e.value)
    assert s["run_id"] == stopped["run_id"] and s["status"] == "completed"
    assert s["rows"] == 15 == s["succeeded"]
    assert len(billed) == s["unique_requests"] and set(billed.values()) == {1}
