"""The job file's policies, each checked on a real run: the budget guard, the eval gate's floor
and its exit code, the exit code of a run where every row failed, the request keys that a changed
prompt, schema or model must renew, `[qa] eval_every_run = false`, the cached-input price of a
long shared prompt, and fan-out of duplicate texts. Real Prefect (the session's harness), the
real OpenAI SDK over HTTP to the emulator, real DuckDB files; the emulator's ledger is the
provider's own count of what was asked and billed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import duckdb
import orjson
import polars as pl
import pytest
from typer.testing import CliRunner

from flows.enrich import enrich
from lowtide.cli import app
from lowtide.emulator import Emulator, EmulatorConfig
from tests.conftest import REPO
from tests.integration.conftest import lowtide_cli, write_job
from tests.sql import query, scalar

pytestmark = pytest.mark.usefixtures("prefect_harness")


@pytest.fixture
def quiet() -> Iterator[Emulator]:
    """An emulator that injects no errors, so every count below is exact."""
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=3)) as emu:
        yield emu


def _state() -> str:
    return os.environ["LOWTIDE_STATE"]


def _asked(emu: Emulator) -> int:
    """Requests the emulator executed and billed."""
    return sum(emu.ledger.count_by_custom_id().values())


def _view(sql: str, params: list | None = None) -> pl.DataFrame:
    """A query against the published file, as an analyst runs it."""
    con = duckdb.connect(os.environ["LOWTIDE_DB"], read_only=True)
    try:
        frame = pl.from_arrow(con.sql(sql, params=params).to_arrow_table())
    finally:
        con.close()
    assert isinstance(frame, pl.DataFrame)
    return frame


def _shown_runs() -> set[str]:
    """The run ids the published job view shows."""
    return set(_view("SELECT DISTINCT run_id FROM support_intents")["run_id"])


def _run_row(run_id: str) -> dict:
    return query(_state(), "SELECT * FROM runs WHERE run_id = ?", [run_id]).row(0, named=True)


def _newest_run() -> dict:
    return query(_state(), "SELECT * FROM runs ORDER BY started_at DESC LIMIT 1").row(0, named=True)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


# -- [cost] budget_usd ----------------------------------------------------------------------------


def test_the_budget_refuses_a_run_quoted_above_it_and_lets_one_quoted_below_it_run(
    quiet: Emulator, tmp_path: Path
) -> None:
    """`lowtide run` compares the same estimate `lowtide estimate` quotes with `[cost]
    budget_usd`: 1% under the quote is refused with exit 2 before anything reaches the provider
    (the line names the estimate, the budget and the key), 1% over it runs."""
    job = write_job(tmp_path, rows=20, eval_rows=5)
    quoted = CliRunner().invoke(app, ["estimate", str(job), "--json"])
    assert quoted.exit_code == 0, quoted.output
    quote = orjson.loads(quoted.stdout)["estimate_usd"]
    assert quote > 0

    under = round(quote * 0.99, 8)
    job.write_text(job.read_text().replace("budget_usd = 5.0", f"budget_usd = {under}"))
    env = {"LOWTIDE_EMULATOR_URL": quiet.base_url}
    refused = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = _error_lines(refused.stderr)
    assert line.startswith("error: ")
    assert f"estimated cost ${quote:.4f}" in line
    assert f"exceeds the budget ${under:g}" in line
    assert "nothing was sent" in line and "[cost] budget_usd" in line
    assert "Traceback" not in refused.stdout + refused.stderr
    # the provider saw nothing: no request executed, none errored
    assert quiet.ledger.executions() == [] and quiet.ledger.errors() == []
    run = _newest_run()
    assert run["status"] == "failed" and "[cost] budget_usd" in run["error"]
    assert run["estimate_usd"] == pytest.approx(quote, rel=1e-9)  # the quote it was refused on
    assert not query(_state(), "SELECT * FROM batches WHERE run_id = ?", [run["run_id"]]).height

    over = round(quote * 1.01, 8)
    job.write_text(job.read_text().replace(f"budget_usd = {under}", f"budget_usd = {over}"))
    ran = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    done = _newest_run()
    assert done["run_id"] != run["run_id"] and done["status"] == "completed"
    assert done["succeeded"] == 20
    assert _asked(quiet) == done["requests_sent"] == done["unique_requests"]


# -- [qa] eval_floor and exit code 3 ----------------------------------------------------------------

# Ten eval messages that each name one intent twice and nothing else the emulator's keyword
# model reacts to, so it answers each with that intent. The gold labels agree on the first
# seven and disagree on the last three: intent accuracy is exactly 7/10.
_EVAL_WORDS = [
    ("refund refund", "refund_request", "refund_request"),
    ("billing billing", "billing_issue", "billing_issue"),
    ("shipping shipping", "shipping_delay", "shipping_delay"),
    ("damaged damaged", "damaged_item", "damaged_item"),
    ("account account", "account_access", "account_access"),
    ("cancel cancel", "cancel_subscription", "cancel_subscription"),
    ("complaint complaint", "complaint", "complaint"),
    ("product product", "product_question", "order_status"),
    ("address address", "change_address", "billing_issue"),
    ("order order", "order_status", "complaint"),
]


def _write_eval_set(tmp_path: Path) -> None:
    pl.DataFrame(
        {
            "eval_id": [f"e{i:02d}" for i in range(len(_EVAL_WORDS))],
            "channel": ["email"] * len(_EVAL_WORDS),
            "body": [words for words, _, _ in _EVAL_WORDS],
            "intent": [gold for _, _, gold in _EVAL_WORDS],
        }
    ).write_csv(tmp_path / "eval.csv")


@pytest.mark.slow
def test_a_field_below_the_eval_floor_holds_the_run_with_exit_3_until_published(
    quiet: Emulator, tmp_path: Path
) -> None:
    floor_at = "seed = 7\neval_floor = 0.7"
    job = write_job(tmp_path, rows=10, replace={"seed = 7": floor_at})
    _write_eval_set(tmp_path)
    env = {"LOWTIDE_EMULATOR_URL": quiet.base_url}

    # accuracy equal to the floor is not below it: the run is published
    passed = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    first = _newest_run()
    assert first["status"] == "completed" and first["gate_note"] in (None, "")
    scores = query(
        _state(),
        "SELECT field, n, correct, accuracy FROM eval_scores WHERE run_id = ?",
        [first["run_id"]],
    )
    assert scores.rows(named=True) == [
        {"field": "intent", "n": 10, "correct": 7, "accuracy": 0.7}
    ]  # only the field the eval set has a gold column for is scored
    assert _shown_runs() == {first["run_id"]}

    job.write_text(job.read_text().replace(floor_at, "seed = 7\neval_floor = 0.75"))
    held = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert held.returncode == 3, held.stdout + held.stderr
    second = _newest_run()
    assert second["run_id"] != first["run_id"]
    (line,) = _error_lines(held.stderr)
    assert line.startswith("held: intent accuracy 70.0% is below the floor 75.0%")
    assert f"`lowtide publish {second['run_id']}`" in line
    assert second["status"] == "held" and second["published_at"] is None
    assert "intent accuracy 70.0% is below the floor 75.0%" in second["gate_note"]
    # the held run's answers are kept, but the analysts' view still shows the first run
    assert second["succeeded"] == 10
    assert _shown_runs() == {first["run_id"]}

    released = lowtide_cli("publish", second["run_id"], cwd=tmp_path, env=env, timeout=120)
    assert released.returncode == 0, released.stdout + released.stderr
    assert _shown_runs() == {second["run_id"]}
    assert _view("SELECT count(*) AS n FROM support_intents")["n"].item() == 10


# -- exit code 1 ------------------------------------------------------------------------------------


def test_a_run_whose_every_row_failed_exits_1_with_the_main_reason(tmp_path: Path) -> None:
    """Every request errors at the provider and nothing retries it: the run ends failed (each
    row failed with its reason, nothing published) and `lowtide run` exits 1 with one line
    saying so."""
    job = write_job(
        tmp_path,
        rows=6,
        eval_rows=2,
        extra="[retry]\nmax_attempts = 1\nrealtime_fallback = false\n",
    )
    with Emulator(EmulatorConfig(time_scale=600.0, error_rate=1.0, seed=3)) as emu:
        done = lowtide_cli(
            "run", str(job), cwd=tmp_path, env={"LOWTIDE_EMULATOR_URL": emu.base_url}
        )
        errored = len(emu.ledger.errors())
        assert emu.ledger.executions() == []  # nothing was answered, nothing billed
    assert done.returncode == 1, done.stdout + done.stderr
    run = _newest_run()
    (line,) = _error_lines(done.stderr)
    assert line.startswith(f"error: every row of run {run['run_id']} failed (6 of 6)")
    assert "main reason: provider_error (6 rows)" in line
    assert run["status"] == "failed" and run["failed"] == 6 and run["succeeded"] == 0
    assert run["published_at"] is None
    assert errored == run["requests_sent"] == run["unique_requests"] == 7  # 5 texts + 2 eval
    failures = query(
        _state(), "SELECT reason FROM failures WHERE run_id = ? AND kind = 'row'", [run["run_id"]]
    )
    assert failures["reason"].to_list() == ["provider_error"] * 6
    assert run["cost_usd"] == 0


# -- request keys: what renews them, what keeps them ----------------------------------------------


def _custom_ids(run_id: str) -> set[str]:
    return set(
        query(
            _state(),
            "SELECT DISTINCT custom_id FROM units WHERE run_id = ? AND custom_id <> ''",
            [run_id],
        )["custom_id"]
    )


@pytest.mark.slow
def test_a_changed_prompt_schema_or_model_asks_every_unit_again_and_nothing_else_does(
    quiet: Emulator, tmp_path: Path
) -> None:
    # the eval set from the cache too, so an unchanged rerun asks nothing; and no gate on eval
    # drift, since a reworded prompt may well change an eval answer
    no_eval_refresh = {"seed = 7": "seed = 7\neval_every_run = false\neval_max_drop = 1.0"}
    job = write_job(tmp_path, rows=15, eval_rows=3, replace=no_eval_refresh)
    base_text = job.read_text()
    base = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert base["status"] == "completed" and base["failed"] == 0
    n = base["unique_requests"]
    assert base["requests_sent"] == n == _asked(quiet)
    seen = _custom_ids(base["run_id"])
    assert len(seen) == n

    # the same job again: every request is a cache hit, the provider is asked nothing
    again = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert again["status"] == "completed" and again["succeeded"] == 15
    assert again["cache_hits"] == n and again["requests_sent"] == 0
    assert _asked(quiet) == n

    # job-file changes outside the question keep the cache
    job.write_text(
        base_text.replace('description = "', 'description = "Reworded. ').replace(
            "sample_rate = 0.05", "sample_rate = 0.2"
        )
    )
    reworded = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert reworded["requests_sent"] == 0 and reworded["cache_hits"] == n
    assert _asked(quiet) == n

    schema = orjson.loads((REPO / "data" / "schemas" / "support-intent.json").read_bytes())
    schema["properties"]["summary"]["maxLength"] = 150
    (tmp_path / "schema.json").write_bytes(orjson.dumps(schema))
    schema_file = str((REPO / "data" / "schemas" / "support-intent.json").resolve())
    changes = {
        "user template": (
            'user_template = "Channel: {channel}\\n\\n{text}"',
            'user_template = "Channel: {channel}\\nMessage: {text}"',
        ),
        "system prompt": ("Reply with the JSON object only", "Answer with the JSON object only"),
        "schema": (f'"{schema_file}"', f'"{tmp_path / "schema.json"}"'),
        "model": ('name = "gpt-4o-mini"', 'name = "gpt-4.1-mini"'),
        "temperature": ("temperature = 0.0", "temperature = 0.2"),
    }
    for what, (old, new) in changes.items():
        assert old in base_text, what
        job.write_text(base_text.replace(old, new))
        before = _asked(quiet)
        changed = enrich(job_file=str(job), emulator_url=quiet.base_url)
        assert changed["status"] == "completed" and changed["failed"] == 0, what
        assert changed["cache_hits"] == 0, what
        assert changed["requests_sent"] == changed["unique_requests"] == n, what
        assert _asked(quiet) - before == n, what  # every unit asked again, at the provider
        ids = _custom_ids(changed["run_id"])
        assert len(ids) == n and not ids & seen, what  # all new request keys
        seen |= ids

    # the original job still finds its own answers: nothing above displaced them
    job.write_text(base_text)
    back = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert back["requests_sent"] == 0 and back["cache_hits"] == n
    assert back["model"] == "gpt-4o-mini"


# -- [qa] eval_every_run ----------------------------------------------------------------------------


def test_with_eval_every_run_false_the_eval_set_is_paid_for_once(
    quiet: Emulator, tmp_path: Path
) -> None:
    """`[qa] eval_every_run = false`: later runs take the eval answers from the cache (an
    unchanged night asks nothing at all; a night with new rows asks only for them) and still
    score the eval set; turned back on, the eval set alone is asked again."""
    replace = {"seed = 7": "seed = 7\neval_every_run = false"}
    job = write_job(tmp_path, rows=8, eval_rows=6, replace=replace)
    first = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert first["status"] == "completed"
    assert _asked(quiet) == first["requests_sent"] == first["unique_requests"]
    asked = _asked(quiet)

    # nothing changed: nothing is asked, and the run reports the eval accuracy it stands on
    same = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert same["status"] == "completed" and same["run_id"] != first["run_id"]
    assert same["requests_sent"] == 0 and _asked(quiet) == asked
    assert same["eval_accuracy"] == first["eval_accuracy"]

    # two more rows: only their requests are sent; the eval set is scored from the cache
    write_job(tmp_path, rows=10, eval_rows=6, replace=replace)
    grown = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert grown["status"] == "completed" and grown["rows"] == 10
    assert grown["cache_hits"] == first["unique_requests"]
    assert 0 < grown["requests_sent"] == grown["unique_requests"] - grown["cache_hits"] <= 2
    assert _asked(quiet) == asked + grown["requests_sent"]
    evals = query(
        _state(),
        "SELECT count(*) AS units, bool_and(cache_hit) AS all_cached FROM units "
        "WHERE run_id = ? AND kind = 'eval'",
        [grown["run_id"]],
    ).row(0, named=True)
    assert evals == {"units": 6, "all_cached": True}
    scores = query(
        _state(),
        "SELECT run_id, field, n, correct FROM eval_scores WHERE run_id IN (?, ?) "
        "ORDER BY run_id, field",
        [first["run_id"], grown["run_id"]],
    )
    mine = scores.filter(pl.col("run_id") == grown["run_id"]).drop("run_id")
    assert mine["field"].to_list() == ["intent", "urgency"] and mine["n"].to_list() == [6, 6]
    assert mine.equals(scores.filter(pl.col("run_id") == first["run_id"]).drop("run_id"))
    assert grown["eval_accuracy"] == first["eval_accuracy"]
    asked = _asked(quiet)

    # turned back on (the default), the eval set is asked afresh, and only the eval set
    job.write_text(job.read_text().replace("eval_every_run = false", "eval_every_run = true"))
    fresh = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert fresh["status"] == "completed"
    assert fresh["requests_sent"] == 6 and _asked(quiet) == asked + 6
    assert fresh["cache_hits"] == fresh["unique_requests"] - 6


# -- cached-input pricing ---------------------------------------------------------------------------


def test_a_long_shared_prompt_is_billed_at_the_cached_input_rate(
    quiet: Emulator, tmp_path: Path
) -> None:
    """A system prompt past OpenAI's 1,024-token cache minimum: every request after the first
    of a batch reads it from the provider's prompt cache, and the costs table prices those
    tokens at the price table's cached-input rate."""
    appendix = "\n".join(
        f"Policy note {i}: parcels from warehouse {i:03d} are handled by team {i % 7} "
        f"and reviewed on weekday {i % 5}."
        for i in range(90)
    )
    end = 'Reply with the JSON object only, no other text."""'
    job = write_job(
        tmp_path,
        rows=30,
        eval_rows=4,
        replace={end: end.removesuffix('"""') + "\n\n" + appendix + '"""'},
    )
    run = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert run["status"] == "completed" and run["failed"] == 0
    billed = quiet.ledger.total_usage()
    sent = run["requests_sent"]
    assert billed["requests"] == sent == run["unique_requests"] > 30  # rows, chunks, eval
    assert 0 < billed["cached_input_tokens"] < billed["input_tokens"]
    # the first request of the batch writes the cache, every one after it reads the prefix
    # (in OpenAI's 128-token steps)
    hits = query(
        _state(),
        "SELECT cached_tokens, count(*) AS n FROM results WHERE run_id = ? GROUP BY 1 ORDER BY 1",
        [run["run_id"]],
    ).rows()
    assert len(hits) == 2 and hits[0] == (0, 1) and hits[1][1] == sent - 1, hits
    assert hits[1][0] >= 1024 and hits[1][0] % 128 == 0
    assert billed["cached_input_tokens"] == (sent - 1) * hits[1][0]

    price = (
        pl.read_csv(REPO / "data" / "prices.csv")
        .filter((pl.col("provider") == "emulator") & (pl.col("model") == "gpt-4o-mini"))
        .row(0, named=True)
    )
    fresh = billed["input_tokens"] - billed["cached_input_tokens"]

    def priced(cached_rate: float, discount: float) -> float:
        return (
            (
                fresh * price["input_usd_per_mtok"]
                + billed["cached_input_tokens"] * cached_rate
                + billed["output_tokens"] * price["output_usd_per_mtok"]
            )
            / 1e6
            * discount
        )

    cost = query(
        _state(),
        "SELECT input_tokens, cached_tokens, output_tokens, cost_usd, realtime_cost_usd "
        "FROM costs WHERE run_id = ? AND level = 'run'",
        [run["run_id"]],
    ).row(0, named=True)
    assert cost["input_tokens"] == billed["input_tokens"]
    assert cost["cached_tokens"] == billed["cached_input_tokens"]
    assert cost["output_tokens"] == billed["output_tokens"]
    batch_price = priced(price["cached_input_usd_per_mtok"], price["batch_discount"])
    assert cost["cost_usd"] == pytest.approx(batch_price, rel=1e-9)
    assert cost["realtime_cost_usd"] == pytest.approx(
        priced(price["cached_input_usd_per_mtok"], 1.0), rel=1e-9
    )
    # and not at the full input rate: the discount on the cached tokens is really taken
    full = priced(price["input_usd_per_mtok"], price["batch_discount"])
    assert full - cost["cost_usd"] == pytest.approx(
        billed["cached_input_tokens"]
        * (price["input_usd_per_mtok"] - price["cached_input_usd_per_mtok"])
        / 1e6
        * price["batch_discount"],
        rel=1e-6,
    )
    assert run["cost_usd"] == pytest.approx(batch_price, rel=1e-9)


# -- dedupe attaches to requests in flight ----------------------------------------------------------


def _batch_members(run_id: str) -> set[str]:
    return set(
        query(
            _state(),
            "SELECT br.custom_id FROM batch_requests br JOIN batches b USING (batch_id) "
            "WHERE b.run_id = ?",
            [run_id],
        )["custom_id"]
    )


@pytest.mark.slow
def test_a_run_over_rows_already_in_flight_attaches_to_that_batch_and_shows_its_answers(
    tmp_path: Path,
) -> None:
    """`lowtide run --no-wait` leaves run A's batch validating at the provider; run B, over the
    same rows and six more, sends only the new rows (and its own eval set) and shows A's rows
    with the answers A's batch brought back."""
    job = write_job(tmp_path, rows=30, eval_rows=3)
    config = EmulatorConfig(time_scale=600.0, error_rate=0.0, seed=3, validating_s=1800)
    with Emulator(config) as emu:
        started = lowtide_cli(
            "run", str(job), "--no-wait", cwd=tmp_path, env={"LOWTIDE_EMULATOR_URL": emu.base_url}
        )
        assert started.returncode == 0, started.stdout + started.stderr
        a = _newest_run()
        assert a["status"] == "submitted"
        assert f"run {a['run_id']}: {a['requests_sent']} requests submitted" in started.stdout
        assert emu.ledger.executions() == []  # A's batch is still in flight
        in_flight = _batch_members(a["run_id"])
        assert len(in_flight) == a["requests_sent"] > 30

        write_job(tmp_path, rows=36, eval_rows=3)
        b = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert b["status"] == "completed" and b["succeeded"] == 36 and b["failed"] == 0
        own = _batch_members(b["run_id"])
        assert own and not own & in_flight  # nothing of A's batch was sent again
        asked = emu.ledger.count_by_custom_id()
        assert set(asked.values()) == {1}
        assert set(asked) == in_flight | own

    b_rows = query(
        _state(),
        "SELECT u.source_id, u.custom_id, r.output, bt.run_id AS answered_in "
        "FROM units u JOIN results r USING (custom_id) JOIN batches bt ON bt.batch_id = r.batch_id "
        "WHERE u.run_id = ? AND u.kind = 'row'",
        [b["run_id"]],
    )
    a_sources = set(
        query(
            _state(),
            "SELECT source_id FROM units WHERE run_id = ? AND kind = 'row'",
            [a["run_id"]],
        )["source_id"]
    )
    attached = b_rows.filter(pl.col("source_id").is_in(list(a_sources)))
    assert attached["source_id"].n_unique() == 30
    assert set(attached["custom_id"]) <= in_flight
    assert set(attached["answered_in"]) == {a["run_id"]}  # the answers came from A's batch
    assert set(b_rows.filter(~pl.col("source_id").is_in(list(a_sources)))["answered_in"]) == {
        b["run_id"]
    }
    shown = _view("SELECT message_id, intent, run_id FROM support_intents")
    assert shown.height == 36 and set(shown["run_id"]) == {b["run_id"]}
    intents = dict(zip(shown["message_id"], shown["intent"], strict=True))
    single = attached.filter(pl.col("source_id").is_unique())  # rows asked in one chunk
    assert single.height > 0
    for source_id, output in single.select("source_id", "output").iter_rows():
        assert intents[source_id] == orjson.loads(output)["intent"]


# -- fan-out of duplicate texts ---------------------------------------------------------------------


def test_duplicate_texts_are_asked_once_and_every_duplicate_gets_the_same_answer(
    quiet: Emulator, tmp_path: Path
) -> None:
    job = write_job(tmp_path, rows=1, eval_rows=2)
    # four questions over twelve rows: exact copies, case and whitespace variants; the same
    # words through another channel render a different message, so they are another question
    groups = {
        "a": ["My parcel is late again", "My parcel is late again", "MY PARCEL IS LATE AGAIN"],
        "b": [
            "The kettle arrived broken",
            "The  kettle arrived\tbroken ",
            "the kettle arrived broken",
        ],
        "c": ["Please refund order 1234", "please refund order 1234", "Please refund order 1234"],
    }
    rows = [
        (f"{g}{i}", "email", body) for g, bodies in groups.items() for i, body in enumerate(bodies)
    ]
    rows += [(f"d{i}", "chat", "My parcel is late again") for i in range(3)]
    pl.DataFrame(
        {
            "message_id": [r[0] for r in rows],
            "channel": [r[1] for r in rows],
            "customer_tier": ["free"] * len(rows),
            "received_at": ["2026-01-01"] * len(rows),
            "body": [r[2] for r in rows],
        }
    ).write_csv(tmp_path / "messages.csv")

    run = enrich(job_file=str(job), emulator_url=quiet.base_url)
    assert run["status"] == "completed" and run["rows"] == 12 and run["succeeded"] == 12
    assert run["unique_requests"] == run["requests_sent"] == 4 + 2  # four questions + eval
    asked = quiet.ledger.count_by_custom_id()
    assert len(asked) == 6 and set(asked.values()) == {1}

    view = _view("SELECT message_id, intent, urgency, summary FROM support_intents")
    view = view.with_columns(pl.col("message_id").str.slice(0, 1).alias("group"))
    assert view.height == 12
    answers = view.group_by("group").agg(
        pl.struct("intent", "urgency", "summary").n_unique().alias("distinct_answers")
    )
    assert answers["distinct_answers"].to_list() == [1, 1, 1, 1]
    # the answer each row shows is its request's answer in the results table
    per_unit = query(
        _state(),
        "SELECT u.source_id, u.custom_id, r.output FROM units u JOIN results r USING (custom_id) "
        "WHERE u.run_id = ? AND u.kind = 'row'",
        [run["run_id"]],
    ).with_columns(pl.col("source_id").str.slice(0, 1).alias("group"))
    assert per_unit.group_by("group").agg(pl.col("custom_id").n_unique())[
        "custom_id"
    ].to_list() == [
        1,
        1,
        1,
        1,
    ]
    shown = dict(zip(view["message_id"], view["intent"], strict=True))
    for source_id, output in per_unit.select("source_id", "output").iter_rows():
        assert shown[source_id] == orjson.loads(output)["intent"]

    # each row carries its share of the one request's price, and the shares add up to the run
    shares = _view(
        "SELECT source_id, units_sharing_request, cost_usd FROM row_costs "
        "WHERE run_id = ? AND kind = 'row'",
        [run["run_id"]],
    )
    assert shares["units_sharing_request"].to_list() == [3] * 12
    row_cost = scalar(
        _state(),
        "SELECT sum(r.cost_usd) FROM results r WHERE r.run_id = ? AND r.custom_id IN "
        "(SELECT custom_id FROM units WHERE run_id = ? AND kind = 'row')",
        [run["run_id"], run["run_id"]],
    )
    assert shares["cost_usd"].sum() == pytest.approx(row_cost, rel=1e-9) and row_cost > 0
