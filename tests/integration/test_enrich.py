"""The whole job through Prefect against the emulator over real HTTP, checked in DuckDB."""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import polars as pl
import pytest

from flows.enrich import enrich
from lowtide.jobspec import load_job
from lowtide.store import Store
from tasks.load import load_eval_set
from tests.conftest import SAMPLE_JOB
from tests.integration.conftest import lowtide_cli, write_job
from tests.leftovers import assert_nothing_left
from tests.sql import query

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _invariant(summary: dict) -> None:
    assert summary["status"] == "completed"
    assert summary["rows"] == summary["succeeded"] + summary["failed"]


def test_sample_job_end_to_end_then_from_cache(emulator, clean_env: Path) -> None:
    eval_set = load_eval_set(load_job(SAMPLE_JOB))
    assert eval_set is not None
    first = enrich(job_file=str(SAMPLE_JOB), emulator_url=emulator.base_url)
    _invariant(first)
    assert first["rows"] == 3000
    assert first["units"] > first["rows"]  # long messages were split
    # dedupe: fewer requests than row units plus one unit per eval row
    assert first["requests_sent"] == first["unique_requests"] < first["units"] + eval_set.height
    assert 0.5 < first["eval_accuracy"] < 0.95
    assert first["cost_usd"] > 0 and first["realtime_cost_usd"] > 2 * first["cost_usd"] * 0.99

    executed = emulator.ledger.count_by_custom_id()
    assert set(executed.values()) == {1}  # every unique request executed once
    store = Store(os.environ["LOWTIDE_STATE"])
    units = query(
        store,
        "SELECT custom_id, count(*) AS n FROM units WHERE run_id = ? AND custom_id <> '' GROUP BY 1",
        [first["run_id"]],
    )
    assert units.height == first["unique_requests"]
    assert units["n"].max() > 1  # duplicates fanned out from one request
    assert set(executed) <= set(units["custom_id"])

    db = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    view = pl.from_arrow(db.sql("SELECT * FROM support_intents").to_arrow_table())
    types = dict(
        db.execute(
            "SELECT column_name, data_type FROM duckdb_columns() "
            "WHERE table_name = 'support_intents'"
        ).fetchall()
    )
    db.close()
    assert types["received_at"] == "DATE"  # the CSV's ISO dates, typed
    assert types["urgency"] == "ENUM('low', 'normal', 'urgent')"  # the schema's enum, in order
    assert view.height == view["message_id"].n_unique() == 3000  # one row per input row
    assert (view["status"] == "succeeded").sum() == first["succeeded"]
    assert view["n_chunks"].max() > 1  # long messages were asked in chunks, and folded back
    assert {"body", "channel", "customer_tier", "intent", "urgency", "summary", "status"} <= set(
        view.columns
    )
    ok = view.filter(pl.col("status") == "succeeded")
    assert (
        ok["intent"]
        .is_in(
            [
                "order_status",
                "refund_request",
                "billing_issue",
                "shipping_delay",
                "damaged_item",
                "account_access",
                "cancel_subscription",
                "product_question",
                "change_address",
                "complaint",
            ]
        )
        .all()
    )
    failed = view.filter(pl.col("status") == "failed")
    assert failed["failure_reason"].is_not_null().all()
    failures = query(
        store, "SELECT * FROM failures WHERE run_id = ? AND kind = 'row'", [first["run_id"]]
    )
    assert failures.height == first["failed"] and failures["reason"].is_not_null().all()

    # the emulator's ~1% per-request errors were retried in a second batch, never billed twice
    errored = {e["custom_id"] for e in emulator.ledger.errors()}
    assert 0 < len(errored) < 100
    retried = query(
        store,
        "SELECT DISTINCT br.custom_id FROM batch_requests br JOIN batches b USING (batch_id) "
        "WHERE b.run_id = ? AND b.attempt > 1",
        [first["run_id"]],
    )
    assert set(retried["custom_id"]) == errored
    assert first["failed"] == 0 and first["succeeded"] == 3000
    # every request answered: the run's messages file beside the state file is gone
    assert store.messages_dir.is_dir() and not list(store.messages_dir.iterdir())
    assert query(store, "SELECT count(user_message) AS n FROM requests")["n"][0] == 0

    second = enrich(job_file=str(SAMPLE_JOB), emulator_url=emulator.base_url)
    _invariant(second)
    assert second["run_id"] != first["run_id"]
    # every row comes from the cache; only the eval set is asked afresh (drift detection)
    evals = query(
        store,
        "SELECT count(*) AS units, count(DISTINCT custom_id) AS requests FROM units "
        "WHERE run_id = ? AND kind = 'eval'",
        [second["run_id"]],
    ).row(0, named=True)
    assert evals["units"] == eval_set.height  # one unit per row of the eval file
    assert second["cache_hits"] == first["unique_requests"] - evals["requests"]
    assert second["requests_sent"] == evals["requests"]
    after = emulator.ledger.count_by_custom_id()
    assert all(after[k] == 1 for k in executed)  # nothing answered before was paid for again
    row_requests = set(units["custom_id"])
    assert not (set(after) - set(executed)) & row_requests
    assert_nothing_left(emulator.base_url, store)


def test_openai_backend_with_base_url_through_the_cli(emulator, tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=40, eval_rows=10)
    env = {"OPENAI_BASE_URL": emulator.openai_base_url, "OPENAI_API_KEY": "x"}
    done = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed" in done.stdout
    status = lowtide_cli("status", "--json", cwd=tmp_path, env=env, timeout=120)
    import orjson

    runs = orjson.loads(status.stdout)
    assert runs[0]["backend"] == "openai" and runs[0]["rows"] == 40
    assert {
        "run_id",
        "job",
        "backend",
        "status",
        "rows",
        "succeeded",
        "failed",
        "requests_sent",
        "cache_hits",
        "cost_usd",
    } <= set(runs[0])
    assert runs[0]["rows"] == runs[0]["succeeded"] + runs[0]["failed"]
    # the emulator's billing ledger: nothing executed twice, and every answer the state file
    # holds was executed (an injected error's retry may or may not happen, so compare with
    # the answers, not with requests_sent minus errors)
    executed = emulator.ledger.count_by_custom_id()
    assert set(executed.values()) <= {1}
    answered = query(
        os.environ["LOWTIDE_STATE"],
        "SELECT custom_id FROM results WHERE outcome IN ('ok', 'repaired')",
    )["custom_id"].to_list()
    assert len(answered) > 0 and set(answered) <= set(executed)
    assert runs[0]["left_at_provider"] == {"count": 0, "bytes": 0}
    assert_nothing_left(emulator.base_url, os.environ["LOWTIDE_STATE"])


def test_missing_input_column_fails_before_sending(emulator, tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=5)
    job.write_text(job.read_text().replace('text_column = "body"', 'text_column = "message"'))
    from tasks.load import InputError

    with pytest.raises(InputError, match=r"missing column\(s\) \['message'\]"):
        enrich(job_file=str(job), emulator_url=emulator.base_url)
    assert emulator.ledger.executions() == []
    run = Store(os.environ["LOWTIDE_STATE"]).list_runs().row(0, named=True)
    assert run["status"] == "failed" and "message" in run["error"]


def test_bad_input_through_the_cli_is_one_line_without_a_trace(emulator, tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=5)
    job.write_text(job.read_text().replace('id_column = "message_id"', 'id_column = "msg"'))
    done = lowtide_cli(
        "run", str(job), cwd=tmp_path, env={"LOWTIDE_EMULATOR_URL": emulator.base_url}
    )
    assert done.returncode == 2
    assert "missing column(s) ['msg']" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert emulator.ledger.executions() == []


def test_an_unreachable_base_url_is_named_in_one_line(tmp_path: Path) -> None:
    """A provider URL on a closed port: after its retries the run stops with one line naming
    the address it could not reach, and stays resumable (nothing was accepted): exit 75, the
    provider is unavailable, retry later."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    job = write_job(tmp_path, rows=5, eval_rows=2)
    env = {"OPENAI_BASE_URL": f"http://127.0.0.1:{closed}/v1", "OPENAI_API_KEY": "x"}
    done = lowtide_cli("run", str(job), "--backend", "openai", cwd=tmp_path, env=env)
    assert done.returncode == 75, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert f"cannot reach http://127.0.0.1:{closed}/v1" in errors[0]
    assert "Traceback" not in done.stderr
