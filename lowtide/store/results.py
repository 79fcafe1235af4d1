"""Results and what is derived from them per run: outcomes, re-asks folded in, prices, the
run's failures, QA sample, eval scores, cost ledger, metrics and review verdicts.

Results are unique by custom_id and written with upserts, so a repeated download changes
nothing, and an answered request is never overwritten by a later failure of another attempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from lowtide.errors import LowtideError
from lowtide.store._db import Database, frame
from lowtide.store._sql import ident
from lowtide.vocabulary import ANSWERED, REALTIME_BACKEND, Outcome

PER_RUN_TABLES = frozenset({"failures", "qa_samples", "eval_scores", "costs", "metrics"})


class ResultsStore(Database):
    def upsert_results(self, results: pl.DataFrame) -> None:
        """Insert or replace results by custom_id; a repeated download changes nothing.

        An answered request is never overwritten by a later failure of another attempt.
        """
        self.upsert_results_in_order([results])

    def upsert_results_in_order(self, parts: list[pl.DataFrame]) -> None:
        """`upsert_results` of each part in turn (several batches' results), in one
        transaction: the results table's last, partly filled row group is compressed again
        once per commit, so one commit for several batches writes it once, not once each."""
        # one row per key even when a caller hands the same request twice (the last wins)
        parts = [
            p.unique(subset="custom_id", keep="last", maintain_order=True)
            for p in parts
            if not p.is_empty()
        ]
        if not parts:
            return
        with self._transaction() as con:
            keys = pl.concat([p.select("custom_id") for p in parts])
            if keys["custom_id"].n_unique() == keys.height and not _stored_among(con, keys):
                # Most nights no key has a stored result yet and none is in two parts: one look
                # for all the parts says so, and every row goes in as it is (a look per part
                # joined every stored key again: ~0.25 s of CPU at 1M results)
                for incoming in parts:
                    _insert_all(con, incoming)
                return
            for incoming in parts:
                if _stored_among(con, incoming.select("custom_id")):
                    _replace_stored(con, incoming)
                else:
                    _insert_all(con, incoming)

    def attempt_counts(self, custom_ids: pl.Series) -> pl.DataFrame:
        """(custom_id, attempts): how many batches (of any channel) each request was sent in,
        once per request however often `custom_ids` names it (several batches' results at once
        may name a request twice)."""
        with self._connect() as con:
            con.register("wanted", pl.DataFrame({"custom_id": custom_ids.unique()}))
            return frame(
                con,
                "SELECT br.custom_id, count(*)::INTEGER AS attempts FROM batch_requests br "
                "JOIN wanted USING (custom_id) GROUP BY 1",
            )

    def results_for(self, custom_ids: pl.Series) -> pl.DataFrame:
        with self._connect() as con:
            con.register("wanted", pl.DataFrame({"custom_id": custom_ids}))
            return frame(con, "SELECT r.* FROM results r JOIN wanted USING (custom_id)")

    def answered_among(self, custom_ids: pl.Series) -> pl.Series:
        """The custom_ids among these that already have a validated answer."""
        found = self.results_for(custom_ids)
        return found.filter(pl.col("outcome").is_in(ANSWERED))["custom_id"]

    def fold_reasks(self) -> None:
        """A re-ask's valid answer repairs the request it re-asked; a failed one adds its reason."""
        with self._transaction() as con:
            con.execute(
                """
                UPDATE results SET outcome = $reasked, output = a.output, error = NULL,
                                   engine = a.engine
                FROM requests q JOIN results a ON a.custom_id = q.custom_id
                WHERE q.reask_of = results.custom_id AND list_contains($answered, a.outcome)
                  AND results.outcome = $parse_failed
                """,
                {
                    "answered": list(ANSWERED),
                    "reasked": Outcome.REASKED.value,
                    "parse_failed": Outcome.PARSE_FAILED.value,
                },
            )
            con.execute(
                """
                UPDATE results
                SET error = results.error || '; re-ask: ' || coalesce(a.error, a.outcome)
                FROM requests q JOIN results a ON a.custom_id = q.custom_id
                WHERE q.reask_of = results.custom_id AND NOT list_contains($answered, a.outcome)
                  AND results.outcome = $parse_failed AND results.error NOT LIKE '%; re-ask: %'
                """,
                {"answered": list(ANSWERED), "parse_failed": Outcome.PARSE_FAILED.value},
            )

    def run_request_outcomes(
        self, run_id: str, outcomes: Sequence[str] | None = None
    ) -> pl.DataFrame:
        """Every request this run sent, with its outcome and how often it was tried; with
        `outcomes`, only those whose result has one of them (a retry round looks at what did
        not come back answered: at a million answered requests the query then reads no tries,
        2.4 -> 0.3 s of CPU)."""
        only = (
            ""
            if outcomes is None
            else "AND br.custom_id IN (SELECT custom_id FROM results "
            "WHERE list_contains($outcomes, outcome))"
        )
        params: dict[str, Any] = {"run": run_id, "realtime": REALTIME_BACKEND}
        if outcomes is not None:
            params["outcomes"] = list(outcomes)
        return self._query(
            f"""
            WITH mine AS (
                SELECT DISTINCT br.custom_id FROM batch_requests br JOIN batches b USING (batch_id)
                WHERE b.run_id = $run {only}
            ), tries AS (
                SELECT br.custom_id,
                       count(*) FILTER (WHERE b.backend <> $realtime) AS batch_attempts,
                       count(*) FILTER (WHERE b.backend = $realtime) AS realtime_attempts
                FROM batch_requests br JOIN batches b USING (batch_id)
                WHERE br.custom_id IN (SELECT custom_id FROM mine) GROUP BY 1
            )
            SELECT m.custom_id, r.outcome, r.error, r.finish_reason,
                   t.batch_attempts, t.realtime_attempts,
                   (q.reask_of IS NOT NULL
                    OR EXISTS (SELECT 1 FROM requests x WHERE x.reask_of = m.custom_id)) AS has_reask
            FROM mine m
            JOIN tries t USING (custom_id)
            LEFT JOIN results r USING (custom_id)
            LEFT JOIN requests q USING (custom_id)
            """,
            params,
        )

    def run_unit_outcomes(
        self, run_id: str, with_output: bool = True, ordered: bool = True
    ) -> pl.DataFrame:
        """Every unit of a run with its request's outcome (null if not answered yet); without
        `with_output`, no answer JSON (the widest column: ~100 MB at a million units, for
        callers that only count); without `ordered`, in no particular order (sorting a million
        units by kind, source_id and chunk_index doubled the query's CPU: 1.3 -> 2.5 s)."""
        output = "r.output, " if with_output else ""
        order = "ORDER BY u.kind, u.source_id, u.chunk_index" if ordered else ""
        return self._query(
            f"""
            SELECT u.unit_id, u.source_id, u.kind, u.chunk_index, u.n_chunks, u.unit_tokens,
                   u.custom_id,
                   u.cache_hit, r.outcome, {output}r.error, r.batch_id, r.input_tokens,
                   r.cached_tokens, r.output_tokens, r.run_id AS answered_in_run
            FROM units u LEFT JOIN results r USING (custom_id)
            WHERE u.run_id = ?
            {order}
            """,
            [run_id],
        )

    def run_unit_usage(self, run_id: str) -> pl.DataFrame:
        """What the run's costs and metrics read of each unit, in no particular order: kind,
        unit_tokens, custom_id, cache_hit, and its request's outcome and tokens (null if not
        answered). Half the bytes of `run_unit_outcomes`, and half its CPU (no ids, errors or
        batch ids: ~0.3 s at a million units)."""
        return self._query(
            """
            SELECT u.kind, u.unit_tokens, u.custom_id, u.cache_hit, r.outcome,
                   r.input_tokens, r.cached_tokens, r.output_tokens
            FROM units u LEFT JOIN results r USING (custom_id)
            WHERE u.run_id = ?
            """,
            [run_id],
        )

    def run_row_failures(
        self, run_id: str, empty_detail: str
    ) -> tuple[pl.DataFrame, dict[str, int]]:
        """The run's failed input rows, each with its first failing unit (by chunk index):
        source_id, kind, unit_id, reason (the unit's outcome, `missing` when it has none,
        `empty_text` when it had nothing to ask, with `empty_detail`) and detail (its error),
        sorted by kind and source_id; and how many rows of each kind the run has. A row failed
        when any of its units has no validated answer. Reckoned in DuckDB: only the failing
        units leave it (a million units fetched to be grouped in polars cost ~1 s of CPU and
        set the run's peak memory)."""
        with self._connect() as con:
            failures = frame(
                con,
                """
                SELECT source_id, kind, first.unit_id AS unit_id, first.reason AS reason,
                       first.detail AS detail
                FROM (
                    SELECT u.source_id, u.kind,
                           arg_min({
                               'unit_id': u.unit_id,
                               'reason': CASE WHEN u.custom_id = '' THEN 'empty_text'
                                              ELSE coalesce(r.outcome, 'missing') END,
                               'detail': CASE WHEN u.custom_id = '' THEN $empty
                                              ELSE r.error END
                           }, u.chunk_index) AS first
                    FROM units u LEFT JOIN results r USING (custom_id)
                    WHERE u.run_id = $run
                      AND NOT coalesce(list_contains($answered, r.outcome), false)
                    GROUP BY u.source_id, u.kind
                )
                ORDER BY kind, source_id
                """,
                {"run": run_id, "answered": list(ANSWERED), "empty": empty_detail},
            )
            counts = con.execute(
                "SELECT kind, count(DISTINCT source_id) FROM units WHERE run_id = ? GROUP BY kind",
                [run_id],
            ).fetchall()
        return failures, {kind: int(n) for kind, n in counts}

    def billed_results(self, run_id: str) -> pl.DataFrame:
        """The results this run received that carry usage (what it is billed for), without
        their answers (the widest columns; pricing reads counts and tokens)."""
        return self._query(
            "SELECT * EXCLUDE (output, raw_text, error) FROM results "
            "WHERE run_id = ? AND input_tokens IS NOT NULL",
            [run_id],
        )

    def set_result_costs(self, priced: pl.DataFrame) -> None:
        """Store each request's price (custom_id, cost_usd) as billed."""
        if priced.is_empty():
            return
        with self._transaction() as con:
            con.register("priced", priced.select("custom_id", "cost_usd"))
            con.execute(
                "UPDATE results SET cost_usd = p.cost_usd FROM priced p "
                "WHERE results.custom_id = p.custom_id"
            )

    def share_batch_cost(self, batch_id: str, usd: float) -> None:
        """Spread a batch's total cost (a pool shard's GPU time) over its answers in proportion
        to their tokens."""
        with self._transaction() as con:
            con.execute(
                """
                UPDATE results SET cost_usd = $usd
                    * (coalesce(input_tokens, 0) + coalesce(output_tokens, 0))
                    / nullif((SELECT sum(coalesce(input_tokens, 0) + coalesce(output_tokens, 0))
                              FROM results WHERE batch_id = $batch), 0)
                WHERE batch_id = $batch
                """,
                {"usd": usd, "batch": batch_id},
            )

    def replace_rows(self, table: str, run_id: str, rows: pl.DataFrame) -> None:
        """Replace a run's rows in a per-run table (failures, qa_samples, eval_scores, costs,
        metrics)."""
        if table not in PER_RUN_TABLES:
            raise LowtideError(f"{table!r} is not a per-run table; one of {sorted(PER_RUN_TABLES)}")
        with self._transaction() as con:
            self._make_room(con, rows.height)  # failures: up to a row per input row
            con.execute(f"DELETE FROM {ident(table)} WHERE run_id = ?", [run_id])
            if rows.height:
                con.register("incoming", rows)
                con.execute(
                    f"INSERT INTO {ident(table)} BY NAME "
                    "SELECT ?::VARCHAR AS run_id, * FROM incoming",
                    [run_id],
                )

    def set_metrics(self, run_id: str, values: dict[str, float | None]) -> None:
        """Insert or replace some of a run's named numbers, leaving the others."""
        with self._transaction() as con:
            con.executemany(
                "INSERT OR REPLACE INTO metrics VALUES (?, ?, ?)",
                [[run_id, name, value] for name, value in values.items()],
            )

    # -- human review ----------------------------------------------------------------------------
    def qa_sample_keys(self, run_ids: list[str]) -> pl.DataFrame:
        """(run_id, unit_id) of the QA samples of these runs."""
        return self._query(
            "SELECT run_id, unit_id FROM qa_samples WHERE list_contains(?, run_id)", [run_ids]
        )

    def record_verdicts(self, reviewed: pl.DataFrame) -> None:
        """A reviewer's (run_id, unit_id, verdict, correct_value) rows onto the QA sample."""
        with self._transaction() as con:
            con.register("incoming", reviewed)
            con.execute(
                "UPDATE qa_samples SET verdict = i.verdict, "
                "correct_value = nullif(i.correct_value, '') FROM incoming i "
                "WHERE qa_samples.run_id = i.run_id AND qa_samples.unit_id = i.unit_id"
            )

    def review_counts(self, run_id: str) -> dict[str, Any]:
        """{correct, n}: the reviewed verdicts of a run's QA sample."""
        return self._query(
            "SELECT count(*) FILTER (WHERE verdict = 'correct') AS correct, "
            "count(*) FILTER (WHERE verdict IN ('correct', 'incorrect')) AS n "
            "FROM qa_samples WHERE run_id = ?",
            [run_id],
        ).row(0, named=True)


# Each helper unregisters its frame only once its statements succeeded: an aborted transaction
# refuses even an unregister, which would hide the error that aborted it.


def _stored_among(con: Any, keys: pl.DataFrame) -> int:
    """How many of these custom_ids have a stored result."""
    con.register("incoming_keys", keys)
    found = con.execute(
        "SELECT count(*) FROM incoming_keys SEMI JOIN results USING (custom_id)"
    ).fetchall()[0][0]
    con.unregister("incoming_keys")
    return int(found)


def _insert_all(con: Any, incoming: pl.DataFrame) -> None:
    """Every row as it is: none has a stored result (1M results: 3.8 -> 3.0 s of CPU against
    the delete and anti join of `_replace_stored`, which each join every stored key)."""
    con.register("incoming", incoming)
    con.execute("INSERT INTO results BY NAME SELECT i.*, now() AS received_at FROM incoming i")
    con.unregister("incoming")


def _replace_stored(con: Any, incoming: pl.DataFrame) -> None:
    """No primary key (migration 16): the stored rows that may be replaced are deleted, then
    every incoming row no stored row keeps is inserted (without the index, 1M results in
    50,000-row upserts took 8.5 s of CPU, not 13.8). An answer stays unless this is its own
    batch's answer again."""
    con.register("incoming", incoming)
    con.execute(
        """
        DELETE FROM results WHERE custom_id IN (
            SELECT r.custom_id FROM incoming i JOIN results r USING (custom_id)
            WHERE NOT list_contains($answered, r.outcome)
               OR list_contains($answered, i.outcome) AND r.batch_id = i.batch_id)
        """,
        {"answered": list(ANSWERED)},
    )
    con.execute(
        "INSERT INTO results BY NAME SELECT i.*, now() AS received_at "
        "FROM incoming i ANTI JOIN results r USING (custom_id)"
    )
    con.unregister("incoming")
