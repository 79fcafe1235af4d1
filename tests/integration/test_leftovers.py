"""Nothing a run uploaded stays at the provider once its results are stored, unless the job
keeps it; what is left anyway (a refused delete, a crash between storing and deleting, an
upload a crash kept from the state file) is listed and deleted by `lowtide leftovers`. The
official SDKs over real HTTP to the emulator, real Prefect, a real DuckDB file."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest
from typer.testing import CliRunner

from flows.enrich import enrich
from lowtide.backends import backend_entry
from lowtide.backends.openai_storage import EXPIRES_AFTER_S
from lowtide.cli import app
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.config import parse_faults
from lowtide.store import Store
from tests.integration.conftest import lowtide_cli, write_job
from tests.leftovers import assert_nothing_left, left_at_emulator
from tests.sql import query

pytestmark = pytest.mark.usefixtures("prefect_harness")

FAST = {"time_scale": 600.0, "error_rate": 0.0, "retry_after_s": 0.01, "seed": 2}
KEEP = "[provider]\nkeep_files = true\n"


def _cli(*args: str) -> tuple[int, Any]:
    """A lowtide command with --json, in this process: (exit code, its JSON output)."""
    result = CliRunner().invoke(app, [*args, "--json"])
    return result.exit_code, orjson.loads(result.stdout)


def _left(run_id: str) -> dict[str, int]:
    """What `lowtide status RUN_ID --json` says the run left at the provider."""
    code, records = _cli("status", run_id)
    assert code == 0
    return records[0]["left_at_provider"]


def _files(emu: Emulator, ids: list[str]) -> list[Any]:
    client = openai.OpenAI(base_url=emu.openai_base_url, api_key="x")
    return [client.files.retrieve(i) for i in ids]


def _strangers(emu: Emulator) -> tuple[str, str]:
    """Another user's file (named like an upload) and Anthropic batch at the same provider."""
    client = openai.OpenAI(base_url=emu.openai_base_url, api_key="x")
    file = client.files.create(file=("b-someone-else.jsonl", b"{}\n"), purpose="batch")
    batch = anthropic.Anthropic(base_url=emu.base_url, api_key="x").messages.batches.create(
        requests=[
            {
                "custom_id": "theirs",
                "params": {
                    "model": "claude-haiku-4-5",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}],
                },
            }
        ]
    )
    return file.id, batch.id


def _still_there(emu: Emulator, strangers: tuple[str, str]) -> None:
    file_id, batch_id = strangers
    openai.OpenAI(base_url=emu.openai_base_url, api_key="x").files.retrieve(file_id)
    anthropic.Anthropic(base_url=emu.base_url, api_key="x").messages.batches.retrieve(batch_id)


@pytest.mark.parametrize("backend", ["openai", "anthropic"])
def test_a_job_that_keeps_its_files_keeps_them_until_it_no_longer_does(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5, extra=KEEP)
    state = os.environ["LOWTIDE_STATE"]
    with Emulator(EmulatorConfig(**FAST)) as emu:
        for variable, value in backend_entry(backend).emulator_env(emu.base_url).items():
            monkeypatch.setenv(variable, value)
        strangers = _strangers(emu)
        s = enrich(job_file=str(job), backend=backend)
        assert s["status"] == "completed" and s["failed"] == 0
        kept = left_at_emulator(emu.base_url, state, s["run_id"])
        assert kept, "the job keeps its files, yet nothing is at the provider"
        assert _left(s["run_id"])["count"] == len(kept)
        if backend == "openai":
            files = _files(emu, kept)
            assert _left(s["run_id"])["bytes"] == sum(f.bytes for f in files) > 0
            # kept files are not given lowtide's week: the provider's retention applies
            assert all(f.expires_at - f.created_at > EXPIRES_AFTER_S for f in files)

        code, listed = _cli("leftovers", str(job), "--backend", backend, "--delete")
        assert code == 0
        assert sorted(i["provider_id"] for i in listed["items"]) == kept
        assert {i["state"] for i in listed["items"]} == {"kept"} and listed["deleted"] == 0
        assert left_at_emulator(emu.base_url, state, s["run_id"]) == kept

        # the job no longer keeps its files: what is there is left, and deleted when asked
        job.write_text(job.read_text().replace("keep_files = true", "keep_files = false"))
        code, swept = _cli("leftovers", str(job), "--backend", backend, "--delete")
        assert code == 0 and swept["left"] == swept["deleted"] == len(kept)
        assert_nothing_left(emu.base_url, state)
        _still_there(emu, strangers)  # another user's things are never touched
        assert _left(s["run_id"]) == {"count": 0, "bytes": 0}
        code, again = _cli("leftovers", str(job), "--backend", backend)
        assert code == 0 and again["items"] == []
        shown = CliRunner().invoke(app, ["leftovers", str(job), "--backend", backend])
        assert shown.exit_code == 0 and "nothing left at the provider" in shown.stdout


def test_a_refused_delete_leaves_the_run_green_and_the_file_listed_expiring_in_a_week(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5)
    state = os.environ["LOWTIDE_STATE"]
    with Emulator(EmulatorConfig(**FAST)) as emu:
        monkeypatch.setenv("LOWTIDE_EMULATOR_URL", emu.base_url)
        strangers = _strangers(emu)
        emu.state.faults.replace(parse_faults("500:DELETE /v1/files/*:*"))
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert s["status"] == "completed" and s["failed"] == 0
        left = left_at_emulator(emu.base_url, state, s["run_id"])
        recorded = query(
            state,
            "SELECT unnest([input_file_id, output_file_id, error_file_id]) AS id FROM batches "
            "WHERE run_id = ?",
            [s["run_id"]],
        )["id"].drop_nulls()
        assert left == sorted(recorded.to_list())  # every input and output file is still there
        files = _files(emu, left)
        # the backstop reached the provider: uploads and result files expire after a week
        assert {f.expires_at - f.created_at for f in files} == {EXPIRES_AFTER_S}
        assert {f.purpose for f in files} == {"batch", "batch_output"}
        assert _left(s["run_id"]) == {"count": len(left), "bytes": sum(f.bytes for f in files)}
        reasons = query(state, "SELECT delete_error FROM provider_items")["delete_error"]
        assert reasons.len() == len(left) and reasons.str.contains("500").all()

        # an upload whose id a crash kept from the state file is found by its name
        batch_id = query(state, "SELECT min(batch_id) AS b FROM batches")["b"][0]
        orphan = openai.OpenAI(base_url=emu.openai_base_url, api_key="x").files.create(
            file=(f"{batch_id}.jsonl", b"{}\n"), purpose="batch"
        )
        shown = CliRunner().invoke(app, ["leftovers", str(job)])
        assert shown.exit_code == 0 and f"{len(left) + 1} left" in shown.stdout
        code, listed = _cli("leftovers", str(job), "--delete")
        assert code == 1  # the provider still refuses: said, and nothing claimed deleted
        assert sorted(i["provider_id"] for i in listed["items"]) == sorted([*left, orphan.id])
        assert listed["failed"] == len(left) + 1 and listed["deleted"] == 0

        emu.state.faults.replace([])
        code, swept = _cli("leftovers", str(job), "--delete")
        assert code == 0 and swept["deleted"] == len(left) + 1
        assert_nothing_left(emu.base_url, state)
        _still_there(emu, strangers)
        assert _left(s["run_id"]) == {"count": 0, "bytes": 0}


@pytest.mark.parametrize("then", ["the next collect", "lowtide leftovers"])
def test_a_crash_between_storing_and_deleting_leaves_nothing_for_long(
    then: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, rows=30, eval_rows=5)
    state = os.environ["LOWTIDE_STATE"]
    with Emulator(EmulatorConfig(**FAST)) as emu:
        crashed = lowtide_cli(
            "run",
            str(job),
            cwd=tmp_path,
            env={"LOWTIDE_EMULATOR_URL": emu.base_url, "LOWTIDE_CRASH_AT": "before_release"},
        )
        assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
        run_id = Store(state).list_runs()["run_id"][0]
        stored = query(
            state,
            "SELECT unnest([input_file_id, output_file_id, error_file_id]) AS id FROM batches "
            "WHERE run_id = ? AND collected AND released_at IS NULL",
            [run_id],
        )["id"].drop_nulls()
        assert stored.len(), "the crash came before any batch was stored"
        assert set(stored) <= set(left_at_emulator(emu.base_url, state, run_id))

        if then == "the next collect":
            summary = enrich(job_file=str(job), emulator_url=emu.base_url)
            assert summary["run_id"] == run_id and summary["status"] == "completed"
        else:
            monkeypatch.setenv("LOWTIDE_EMULATOR_URL", emu.base_url)
            code, swept = _cli("leftovers", str(job), "--delete")
            assert code == 0 and swept["deleted"] >= stored.len()
        assert_nothing_left(emu.base_url, state, run_id)
        assert set(emu.ledger.count_by_custom_id().values()) == {1}
