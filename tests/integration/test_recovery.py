"""Partial outcomes end answered or failed with a reason, and nothing is paid twice.

Each test runs a small copy of the sample job through the real flow, the real SDKs over HTTP
and a real emulator configured for one awkward case, then checks the store and the ledger.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import orjson
import polars as pl
import pytest

from flows.collect import collect
from flows.enrich import enrich
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.errors import RunFailedError, RunHeldError
from lowtide.pricing import load_price
from lowtide.store import Store
from tests.integration.conftest import advance_clock, cancel_through_cli, write_job
from tests.leftovers import assert_nothing_left
from tests.sql import query, scalar

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _store() -> Store:
    return Store(os.environ["LOWTIDE_STATE"])


def _invariant(summary: dict, rows: int) -> None:
    assert summary["rows"] == rows == summary["succeeded"] + summary["failed"]


def _nothing_left(emu: Emulator) -> None:
    """Nothing of the state file's runs is left at the emulated provider."""
    assert_nothing_left(emu.base_url, os.environ["LOWTIDE_STATE"])


def _paid_once(emu: Emulator) -> dict[str, int]:
    counts = emu.ledger.count_by_custom_id()
    assert set(counts.values()) <= {1}, "a request was paid for twice"
    return counts


def test_expired_batch_keeps_finished_results_and_resubmits_only_the_rest(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=40, eval_rows=5)
    # 45 requests at 1 simulated second each in a 30 s window: the tail expires unrun
    config = EmulatorConfig(
        time_scale=400.0,
        error_rate=0.0,
        validating_s=1,
        finalizing_s=1,
        batch_seconds_per_request=1.0,
        completion_window_s=30.0,
    )
    with Emulator(config) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        _invariant(s, 40)
        _paid_once(emu)
        store = _store()
        batches = store.run_batches(s["run_id"])
        assert batches["status"].to_list()[0] == "expired"
        assert batches["attempt"].max() >= 2
        first = batches.row(0, named=True)["batch_id"]
        answered_first = set(
            query(store, "SELECT custom_id FROM results WHERE batch_id = ?", [first])["custom_id"]
        )
        later = set(
            query(
                store,
                "SELECT br.custom_id FROM batch_requests br JOIN batches b USING (batch_id) "
                "WHERE b.run_id = ? AND b.attempt > 1",
                [s["run_id"]],
            )["custom_id"]
        )
        assert answered_first and later
        assert not answered_first & later  # only the unfinished remainder was resubmitted
        _nothing_left(emu)


def test_errored_requests_retry_then_fail_with_a_reason(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        rows=20,
        eval_rows=5,
        extra="[retry]\nmax_attempts = 2\nrealtime_fallback = false\n",
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=1.0)) as emu:
        with pytest.raises(RunFailedError) as ended:  # every row failed: the flow run fails
            enrich(job_file=str(job), emulator_url=emu.base_url)
        s = ended.value.summary
        _invariant(s, 20)
        assert s["failed"] == 20 and s["status"] == "failed" and s["published_at"] is None
        assert emu.ledger.executions() == []  # errored requests are not billed
        _nothing_left(emu)
        store = _store()
        attempts = query(
            store,
            "SELECT custom_id, count(*) AS n FROM batch_requests br JOIN batches b USING (batch_id) "
            "WHERE b.run_id = ? GROUP BY 1",
            [s["run_id"]],
        )
        assert set(attempts["n"]) == {2}
        failures = query(
            store,
            "SELECT reason, detail FROM failures WHERE run_id = ? AND kind = 'row'",
            [s["run_id"]],
        )
        assert set(failures["reason"]) == {"provider_error"}
        assert all(d.startswith("HTTP 5") for d in failures["detail"])


def test_stragglers_go_through_the_realtime_path(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5, extra="[retry]\nmax_attempts = 1\n")
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=1.0)) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        _invariant(s, 20)
        assert s["succeeded"] == 20
        realtime = [e for e in emu.ledger.executions() if e["kind"] == "realtime"]
        assert len(realtime) == s["unique_requests"]
        store = _store()
        channels = query(
            store, "SELECT DISTINCT channel FROM results WHERE run_id = ?", [s["run_id"]]
        )
        assert channels["channel"].to_list() == ["realtime"]
        costs = query(
            store,
            "SELECT cost_usd, realtime_cost_usd FROM costs WHERE run_id = ? AND level = 'run'",
            [s["run_id"]],
        ).row(0, named=True)
        assert costs["cost_usd"] == pytest.approx(costs["realtime_cost_usd"])  # no batch discount


def test_a_batch_that_fails_validation_reports_the_providers_line_errors(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, max_batch_lines=10)) as emu:
        with pytest.raises(RunFailedError) as ended:
            enrich(job_file=str(job), emulator_url=emu.base_url)
        s = ended.value.summary
        _invariant(s, 20)
        assert s["failed"] == 20 and s["status"] == "failed"
        detail = query(
            _store(), "SELECT DISTINCT detail FROM failures WHERE run_id = ?", [s["run_id"]]
        )
        assert any("batch failed validation at the provider: line" in d for d in detail["detail"])
        _nothing_left(emu)


def test_429_on_create_is_retried(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=10, eval_rows=3)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, retry_after_s=0.05)) as emu:
        from lowtide.emulator.config import parse_faults

        emu.state.faults.replace(parse_faults("429:POST /v1/batches:2"))
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        _invariant(s, 10)
        assert s["succeeded"] == 10
        assert len(_store().run_batches(s["run_id"])) == 1
        _nothing_left(emu)


def test_no_wait_then_collect_gives_the_same_tables_as_waiting(tmp_path: Path, monkeypatch) -> None:
    job = write_job(tmp_path, rows=60, eval_rows=10)
    config = dict(time_scale=60.0, error_rate=0.05, seed=11)

    def view() -> pl.DataFrame:
        con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
        try:
            return pl.from_arrow(
                con.sql(
                    "SELECT message_id, n_chunks, status, intent, urgency, summary FROM support_intents "
                    "ORDER BY 1, 2"
                ).to_arrow_table()
            )
        finally:
            con.close()

    with Emulator(EmulatorConfig(**config)) as emu:
        waited = enrich(job_file=str(job), emulator_url=emu.base_url)
        waited_view = view()
    monkeypatch.setenv("LOWTIDE_STATE", str(tmp_path / "other-state.duckdb"))
    monkeypatch.setenv("LOWTIDE_DB", str(tmp_path / "other.duckdb"))
    with Emulator(EmulatorConfig(**config)) as emu:
        submitted = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        assert submitted["status"] == "submitted"
        for _ in range(100):
            touched = collect(emulator_url=emu.base_url)
            if touched and touched[0]["status"] == "completed":
                break
        else:
            pytest.fail("collect never finished the run")
        _paid_once(emu)
        _nothing_left(emu)
        finished = touched[0]
    assert finished["rows"] == waited["rows"] and finished["succeeded"] == waited["succeeded"]
    assert view().equals(waited_view)


def test_cancel_keeps_finished_work_and_fails_the_rest_with_a_reason(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=30, eval_rows=5)
    config = EmulatorConfig(
        time_scale=0.0,
        error_rate=0.0,
        validating_s=1,
        finalizing_s=1,
        batch_seconds_per_request=1.0,
        cancel_drain_s=1,
    )
    with Emulator(config) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        advance_clock(emu, 15)
        store = _store()
        cancel_through_cli(emu, s["run_id"])
        assert store.get_run(s["run_id"])["status"] == "cancelling"
        advance_clock(emu, 5)
        done = collect(emulator_url=emu.base_url)[0]
        assert done["status"] == "cancelled"
        _invariant(done, 30)
        assert 0 < done["succeeded"] < 30
        reasons = query(
            store,
            "SELECT DISTINCT reason FROM failures WHERE run_id = ? AND kind = 'row'",
            [s["run_id"]],
        )
        assert reasons["reason"].to_list() == ["cancelled"]
        assert len(_paid_once(emu)) >= done["succeeded"]
        _nothing_left(emu)


def test_cancel_while_the_provider_validates_ends_every_row_cancelled(tmp_path: Path) -> None:
    """Nothing ran, so nothing was lost: every row is `cancelled` with that reason, not
    `missing`, and the emulator executed no request."""
    job = write_job(tmp_path, rows=20, eval_rows=5)
    config = EmulatorConfig(time_scale=0.0, error_rate=0.0, validating_s=3600, cancel_drain_s=1)
    with Emulator(config) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        store = _store()
        cancel_through_cli(emu, s["run_id"])
        advance_clock(emu, 5)
        done = collect(emulator_url=emu.base_url)[0]
        assert done["status"] == "cancelled"
        _invariant(done, 20)
        assert done["failed"] == 20
        failures = query(
            store,
            "SELECT reason, detail, count(*) AS n FROM failures WHERE run_id = ? AND kind = 'row' "
            "GROUP BY ALL",
            [s["run_id"]],
        )
        assert failures.rows() == [
            ("cancelled", "the batch was cancelled before this request ran", 20)
        ]
        assert emu.ledger.count_by_custom_id() == {}
        _nothing_left(emu)


def test_malformed_answers_are_repaired_or_reasked(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=400, eval_rows=10)
    with Emulator(
        EmulatorConfig(time_scale=600.0, error_rate=0.0, malformed_rate=0.05, seed=5)
    ) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        _invariant(s, 400)
        _paid_once(emu)
    store = _store()
    outcomes = query(
        store,
        "SELECT r.outcome, r.error FROM results r JOIN requests q USING (custom_id) "
        "WHERE r.run_id = ? AND q.reask_of IS NULL",
        [s["run_id"]],
    )
    counts = dict(outcomes.group_by("outcome").len().iter_rows())
    broken = counts.get("repaired", 0) + counts.get("reasked", 0) + counts.get("parse_failed", 0)
    assert broken > 0.02 * outcomes.height  # the emulator did break answers
    fixed = counts.get("repaired", 0) + counts.get("reasked", 0)
    assert fixed >= 0.95 * broken
    assert outcomes.filter(pl.col("outcome") == "parse_failed")["error"].is_not_null().all()


def test_costs_add_up_to_the_providers_usage_and_the_estimate_is_close(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=300, eval_rows=20)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        usage = emu.ledger.total_usage()
    price = load_price(
        Path(__file__).resolve().parents[2] / "data" / "prices.csv", "emulator", "gpt-4o-mini"
    )
    expected = price.cost(
        usage["input_tokens"], usage["cached_input_tokens"], usage["output_tokens"], batch=True
    )
    store = _store()
    costs = query(
        store, "SELECT level, cost_usd, estimate_usd FROM costs WHERE run_id = ?", [s["run_id"]]
    )
    run_row = costs.filter(pl.col("level") == "run").row(0, named=True)
    # what the emulator billed, priced exactly (only float summation order may differ)
    assert run_row["cost_usd"] == pytest.approx(expected, rel=1e-9)
    assert costs.filter(pl.col("level") == "batch")["cost_usd"].sum() == pytest.approx(
        run_row["cost_usd"]
    )
    per_request = scalar(store, "SELECT sum(cost_usd) FROM results WHERE run_id = ?", [s["run_id"]])
    assert per_request == pytest.approx(run_row["cost_usd"])
    assert abs(run_row["estimate_usd"] - run_row["cost_usd"]) <= 0.10 * run_row["cost_usd"]


def test_eval_gate_holds_a_drifted_run_until_published(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from lowtide.cli import app

    job = write_job(
        tmp_path, rows=30, eval_rows=200, replace={"seed = 7": "seed = 7\neval_max_drop = 0.005"}
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        first = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert first["status"] == "completed"
        emu.state.patch_config({"model_version": 2})
        with pytest.raises(RunHeldError) as held:  # a held night fails its flow run
            enrich(job_file=str(job), emulator_url=emu.base_url)
    second = held.value.summary
    assert second["status"] == "held", second
    assert "accuracy fell" in second["gate_note"]
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    shown = {r[0] for r in con.execute("SELECT DISTINCT run_id FROM support_intents").fetchall()}
    con.close()
    assert shown == {first["run_id"]}
    result = CliRunner().invoke(app, ["publish", second["run_id"]])
    assert result.exit_code == 0, result.output
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    shown = {r[0] for r in con.execute("SELECT DISTINCT run_id FROM support_intents").fetchall()}
    con.close()
    assert shown == {second["run_id"]}


def test_qa_export_import_round_trip(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from lowtide.cli import app

    job = write_job(
        tmp_path, rows=200, eval_rows=5, replace={"sample_rate = 0.05": "sample_rate = 0.1"}
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
    out = tmp_path / "review.csv"
    result = CliRunner().invoke(app, ["qa", "export", s["run_id"], "--out", str(out)])
    assert result.exit_code == 0, result.output
    sample = pl.read_csv(out, infer_schema=False)
    assert {"run_id", "unit_id", "message_id", "body", "intent", "verdict", "correct_value"} <= set(
        sample.columns
    )
    assert sample["verdict"].fill_null("").eq("").all()
    n = sample.height
    assert n >= 10
    labels = pl.read_csv(Path(__file__).resolve().parents[2] / "data" / "support" / "labels.csv")
    reviewed = sample.join(
        labels.select("message_id", pl.col("intent").alias("truth")), on="message_id"
    )
    reviewed = reviewed.with_columns(
        pl.when(pl.col("intent") == pl.col("truth"))
        .then(pl.lit("correct"))
        .otherwise(pl.lit("incorrect"))
        .alias("verdict"),
        pl.when(pl.col("intent") != pl.col("truth"))
        .then(pl.col("truth"))
        .otherwise(pl.lit(""))
        .alias("correct_value"),
    ).drop("truth")
    reviewed.write_csv(out)
    result = CliRunner().invoke(app, ["qa", "import", str(out)])
    assert result.exit_code == 0, result.output
    right = int((reviewed["verdict"] == "correct").sum())
    assert f"accuracy {right / n:.1%}" in result.output
    metrics = dict(
        query(
            _store(), "SELECT name, value FROM metrics WHERE run_id = ?", [s["run_id"]]
        ).iter_rows()
    )
    assert metrics["qa_reviewed"] == n
    assert (
        metrics["qa_accuracy_ci_low"]
        < metrics["qa_reviewed_accuracy"]
        < metrics["qa_accuracy_ci_high"]
    )
    from flows.report import qa_report

    (report,) = qa_report()
    assert f"{n} of {n} sampled rows reviewed: accuracy {right / n:.1%}" in report
    assert "## Eval set, last runs" in report and s["run_id"] in report
    bad = tmp_path / "bad.csv"
    reviewed.with_columns(pl.lit("maybe").alias("verdict")).write_csv(bad)
    result = CliRunner().invoke(app, ["qa", "import", str(bad)])
    assert result.exit_code != 0 and "row 2: verdict 'maybe'" in result.output


def test_same_job_on_anthropic_gives_the_same_rows(tmp_path: Path, monkeypatch) -> None:
    job = write_job(tmp_path, rows=40, eval_rows=5)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        on_openai = enrich(job_file=str(job), emulator_url=emu.base_url)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", emu.anthropic_base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "x")
        on_anthropic = enrich(job_file=str(job), backend="anthropic")
        assert {e["provider"] for e in emu.ledger.executions()} == {"openai", "anthropic"}
        _nothing_left(emu)
    assert on_anthropic["model"] == "claude-haiku-4-5" and on_anthropic["succeeded"] == 40
    store = _store()

    def outputs(run_id: str) -> dict[str, dict]:
        rows = query(
            store,
            "SELECT u.unit_id, r.output FROM units u JOIN results r USING (custom_id) "
            "WHERE u.run_id = ? AND u.kind = 'row'",
            [run_id],
        )
        return {
            u: {k: v for k, v in orjson.loads(o).items() if k != "summary"}
            for u, o in rows.iter_rows()
        }

    assert outputs(on_anthropic["run_id"]) == outputs(on_openai["run_id"])


def test_urgent_rows_go_realtime_at_once(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        rows=30,
        eval_rows=5,
        replace={'text_column = "body"': 'text_column = "body"\npriority_column = "urgent"'},
    )
    messages = pl.read_csv(tmp_path / "messages.csv")
    messages.with_columns((pl.int_range(pl.len()) < 4).alias("urgent")).write_csv(
        tmp_path / "messages.csv"
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        _invariant(s, 30)
        assert s["succeeded"] == 30
        kinds = [e["kind"] for e in emu.ledger.executions()]
        assert kinds.count("realtime") == 4
        assert kinds.count("batch") == s["unique_requests"] - 4
    channels = query(
        _store(),
        "SELECT u.source_id, u.custom_id, r.channel FROM units u JOIN results r USING (custom_id) "
        "WHERE u.run_id = ? AND u.kind = 'row'",
        [s["run_id"]],
    )
    urgent_ids = messages.head(4)["message_id"].implode()
    urgent_requests = set(channels.filter(pl.col("source_id").is_in(urgent_ids))["custom_id"])
    realtime = channels.filter(pl.col("channel") == "realtime")
    assert set(realtime["custom_id"]) == urgent_requests  # rows sharing an urgent request too


def test_past_the_deadline_stragglers_skip_further_batches(tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        rows=10,
        eval_rows=3,
        extra="[retry]\nmax_attempts = 5\ndeadline_hours = 0.00001\n",
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=1.0)) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
        _invariant(s, 10)
        assert s["succeeded"] == 10  # answered through realtime
    attempts = query(
        _store(),
        "SELECT max(attempt) AS a FROM batches WHERE run_id = ? AND backend <> 'realtime'",
        [s["run_id"]],
    )
    assert attempts["a"][0] == 1  # no second batch attempt once the deadline had passed


def test_a_changed_input_starts_a_new_run_and_a_driven_run_is_not_taken(tmp_path: Path) -> None:
    from lowtide.lease import RunBusyError

    job = write_job(tmp_path, rows=10, eval_rows=3)
    with Emulator(EmulatorConfig(time_scale=0.0, error_rate=0.0)) as emu:
        first = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        assert first["status"] == "submitted"
        store = _store()
        store.claim_run(first["run_id"], "elsewhere:1:other", 600)  # a live driver elsewhere
        with pytest.raises(RunBusyError, match="being driven by another lowtide process"):
            enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        store.release_run(first["run_id"], "elsewhere:1:other")
        messages = pl.read_csv(tmp_path / "messages.csv")
        pl.concat(
            [messages, messages.head(1).with_columns(pl.lit("m_new").alias("message_id"))]
        ).write_csv(tmp_path / "messages.csv")
        second = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        assert second["run_id"] != first["run_id"]  # today's input is not last night's run
        assert second["rows"] == 11


def test_a_publish_that_fails_leaves_the_old_file_and_the_run_unpublished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The published file cannot be written (here its folder is a file; a full disk is the
    same path through the code): the old file stays as it was, the run keeps its answers but is
    not shown as published, its error says how to retry, and `lowtide publish` then works."""
    from flows.operations import publish_run
    from lowtide.errors import PublishError
    from lowtide.settings import Settings

    job = write_job(tmp_path, rows=12, eval_rows=4)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        first = enrich(job_file=str(job), emulator_url=emu.base_url)
        good = Path(os.environ["LOWTIDE_DB"])
        before = good.read_bytes()
        (tmp_path / "not-a-folder").write_text("x")
        monkeypatch.setenv("LOWTIDE_DB", str(tmp_path / "not-a-folder" / "lowtide.duckdb"))
        job.write_text(job.read_text().replace("temperature = 0.0", "temperature = 0.1"))
        with pytest.raises(
            PublishError, match=r"not-a-folder/lowtide\.duckdb: cannot write the published file"
        ):
            enrich(job_file=str(job), emulator_url=emu.base_url)
    store = _store()
    second = store.list_runs().row(0, named=True)
    assert second["run_id"] != first["run_id"]
    assert second["status"] == "completed" and second["published_at"] is None
    assert f"lowtide publish {second['run_id']}" in second["error"]
    assert good.read_bytes() == before  # the analysts' file was not touched
    publish_run(Settings(db=good), second["run_id"])
    con = duckdb.connect(str(good), read_only=True)
    shown = con.execute("SELECT DISTINCT run_id FROM support_intents").fetchall()
    con.close()
    assert shown == [(second["run_id"],)]
    assert store.get_run(second["run_id"])["published_at"] is not None


def test_a_run_waits_for_the_batch_it_attached_to_and_an_older_run_never_replaces_it(
    tmp_path: Path,
) -> None:
    """Run A is left in flight (--no-wait); the input grows by 10 rows; run B attaches to A's
    in-flight requests instead of sending them again. B waits for and collects A's batch, so all
    110 rows end answered, and a later `collect` of A does not put A's 100 rows back in the view."""
    job = write_job(tmp_path, rows=100, eval_rows=5)
    # A's batch validates for 30 simulated minutes (3 s here), so it is still in flight when
    # B is prepared; whatever the machine's speed, B's dedupe sees it as unfinished in the
    # store, because nobody polls A's batches until B (or collect) does
    config = EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=3, validating_s=1800)
    with Emulator(config) as emu:
        a = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        assert a["status"] == "submitted"
        write_job(tmp_path, rows=110, eval_rows=5)
        b = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert b["run_id"] != a["run_id"]
        assert b["status"] == "completed"
        _invariant(b, 110)
        assert b["succeeded"] == 110 and b["failed"] == 0
        collected = collect(emulator_url=emu.base_url)
        assert [c["run_id"] for c in collected] == [a["run_id"]]
        assert collected[0]["status"] == "completed" and collected[0]["succeeded"] == 100
        _paid_once(emu)
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    shown = con.execute("SELECT DISTINCT run_id, count(*) OVER () FROM support_intents").fetchall()
    con.close()
    assert shown == [(b["run_id"], 110)]


@pytest.mark.parametrize("keep", [False, True])
def test_a_finished_runs_work_files_are_removed_unless_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """Everything a finished run needs is in the state file; its parquet files only took disk
    (nightly runs added a copy each). LOWTIDE_KEEP_WORK_DIR keeps them for debugging."""
    if keep:
        monkeypatch.setenv("LOWTIDE_KEEP_WORK_DIR", "1")
    job = write_job(tmp_path, rows=10, eval_rows=3)
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0)) as emu:
        s = enrich(job_file=str(job), emulator_url=emu.base_url)
    assert s["status"] == "completed"
    run_dir = Path(os.environ["LOWTIDE_WORK_DIR"]) / s["run_id"]
    assert run_dir.is_dir() == keep
    if keep:
        assert any(run_dir.glob("*.parquet"))
