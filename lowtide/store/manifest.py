"""The write-ahead manifest: a run's sources and units, its requests, and the batches that carry
them, with every provider id committed the moment it returns.

A batch row exists (`pending`) before anything is sent; `record_uploaded` and `record_created`
store each step's id; a batch with a provider id is never sent again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import polars as pl

from lowtide.crashpoints import crash_point
from lowtide.errors import LowtideError
from lowtide.store import message_files
from lowtide.store._db import INSERT_SLICE_ROWS, frame, insert_in_slices
from lowtide.store.lines import LinesStore
from lowtide.store.runs import now as _sent_now
from lowtide.vocabulary import (
    ANSWERED,
    REALTIME_BACKEND,
    RESUMABLE_RUN,
    TERMINAL,
    UNSENT,
    BatchStatus,
    sql_list,
)


def _poll_fields(state: Any) -> dict[str, Any]:
    """The batch columns one observation (`BatchState`) sets."""
    return {
        "status": state.status.value,
        "provider_status": state.provider_status,
        "output_file_id": state.output_file_id,
        "error_file_id": state.error_file_id,
        "result_ref": state.result_ref,
        "request_counts": orjson.dumps(state.counts).decode(),
        "errors": orjson.dumps(state.errors).decode() if state.errors else None,
        "usage": orjson.dumps(state.usage).decode() if state.usage else None,
    }


def _errors_json(code: str, message: str) -> str:
    return orjson.dumps([{"code": code, "message": message}]).decode()


_CARRIED = """
    SELECT DISTINCT br.batch_id FROM batch_requests br
    JOIN batches b ON b.batch_id = br.batch_id
        AND b.run_id <> $run AND NOT b.collected
        AND b.backend = (SELECT backend FROM runs WHERE run_id = $run)
    JOIN units u ON u.custom_id = br.custom_id AND u.run_id = $run
"""
"""Another run's uncollected batches, on this run's backend, that hold one of this run's
requests: what dedupe attached to instead of sending again."""


_NOT_STORED = " ANTI JOIN requests USING (custom_id)"
"""Appended to an insert into `requests`: a request stored already is kept as it is (the table
carries no key since migration 16)."""


class ManifestStore(LinesStore):
    # -- units ---------------------------------------------------------------------------------
    def save_units(
        self,
        run_id: str,
        units: pl.DataFrame,
        carried_from: str | None = None,
        carried: pl.DataFrame | None = None,
    ) -> None:
        """The run's units; with `carried_from`, also that run's row units of the input rows in
        `carried` (source_id), copied as cache hits (`CarryStore.unchanged_answered_rows`)."""
        with self._transaction() as con:
            # no key on units (migration 16): the run's units are replaced whole
            con.register("incoming", units)
            con.execute("DELETE FROM units WHERE run_id = ?", [run_id])
            con.execute(
                "INSERT INTO units BY NAME SELECT ?::VARCHAR AS run_id, unit_id, source_id, kind, "
                "chunk_index, n_chunks, unit_tokens, custom_id, cache_hit FROM incoming",
                [run_id],
            )
            if carried_from is not None and carried is not None and carried.height:
                con.register("carried", carried.select("source_id"))
                con.execute(
                    "INSERT INTO units BY NAME SELECT ?::VARCHAR AS run_id, unit_id, source_id, "
                    "kind, chunk_index, n_chunks, unit_tokens, custom_id, true AS cache_hit "
                    "FROM units WHERE run_id = ? AND kind = 'row' "
                    "AND source_id IN (SELECT source_id FROM carried)",
                    [run_id, carried_from],
                )

    def prepared_counts(self, run_id: str) -> dict[str, int]:
        """The run's row units, distinct requests (eval set included) and distinct requests an
        earlier run answered, as saved."""
        with self._connect() as con:
            row = con.execute(
                "SELECT count(*) FILTER (kind = 'row'), "
                "count(DISTINCT custom_id) FILTER (custom_id <> ''), "
                "count(DISTINCT custom_id) FILTER (cache_hit AND custom_id <> '') "
                "FROM units WHERE run_id = ?",
                [run_id],
            ).fetchone()
        assert row is not None
        return {"row_units": row[0], "unique_requests": row[1], "cache_hits": row[2]}

    def known_outcomes(self, custom_ids: pl.Series) -> pl.DataFrame:
        """Which of these requests are already answered, or already in a live batch."""
        with self._connect() as con:
            con.register("wanted", pl.DataFrame({"custom_id": custom_ids}))
            return frame(
                con,
                """
                SELECT w.custom_id,
                       coalesce(list_contains(?, r.outcome), false) AS answered,
                       EXISTS (SELECT 1 FROM batch_requests br JOIN batches b USING (batch_id)
                               JOIN runs ON runs.run_id = b.run_id
                               WHERE br.custom_id = w.custom_id
                                 AND list_contains(?, runs.status)
                                 AND (NOT list_contains(?, b.status) OR NOT b.collected))
                           AS in_flight
                FROM wanted w LEFT JOIN results r USING (custom_id)
                """,
                [list(ANSWERED), sql_list(RESUMABLE_RUN), sql_list(TERMINAL)],
            )

    # -- the manifest ----------------------------------------------------------------------------
    def write_manifest(
        self,
        run_id: str,
        requests: pl.DataFrame,
        batches: pl.DataFrame,
        members: pl.DataFrame,
        messages: str | Path | None = None,
    ) -> None:
        """Request lines and pending batch rows, before anything is sent. With `messages`, a
        parquet file of (custom_id, user) holding every request's message, the file itself is
        kept beside the state file (`message_files.keep`) and each request stored names it
        (`message_file`): the messages never pass through Python or DuckDB's compression here.
        Requests are stored a slice at a time, each slice committed on its own, and the batch
        rows last. A run has a manifest once its batch rows exist (`has_manifest`): until then
        nothing is sent, and a resumed run writes it again (with a new file), its requests
        already stored kept as they are. A run that fails here leaves the requests it stored,
        unsent (no batch row names them): a later run asking the same sends them, keeping the
        stored rows."""
        optional = "".join(
            f", {c}"
            for c in ("line", "user_message", "template_id", "reask_of")
            if c in requests.columns
        )
        if (
            messages is None
            and requests.height
            and not {"line", "user_message"} & set(requests.columns)
        ):
            raise LowtideError("write_manifest: requests carry no line, no message and no file")
        insert = (
            "INSERT INTO requests BY NAME SELECT custom_id, request_key, job, model, "
            f"?::VARCHAR AS first_run_id, est_input_tokens, now() AS created_at{optional} "
        )
        if messages is not None:
            self._insert_with_messages(requests, Path(messages), insert, run_id)
        with self._transaction() as con:
            if messages is None:
                insert_in_slices(con, requests, insert + "FROM incoming" + _NOT_STORED, [run_id])
            est_tokens = "est_tokens" if "est_tokens" in batches.columns else "NULL::BIGINT"
            con.register("bat", batches)
            con.register("mem", members)
            con.execute(
                "INSERT INTO batches BY NAME SELECT batch_id, ?::VARCHAR AS run_id, shard, attempt, "
                f"backend, ? AS status, n_requests, n_bytes, {est_tokens} AS est_tokens, "
                "false AS collected, now() AS created_at, now() AS updated_at FROM bat",
                [run_id, BatchStatus.PENDING.value],
            )
            # no key on batch_requests (migration 16): a plan names each request once, and a
            # batch row that exists already refuses this whole transaction
            con.execute("INSERT INTO batch_requests SELECT batch_id, custom_id FROM mem")

    def _insert_with_messages(
        self, requests: pl.DataFrame, messages: Path, insert: str, run_id: str
    ) -> None:
        """The requests' rows, each naming the kept copy of the file `messages` that holds its
        message."""
        with self._connect() as con:
            con.register("incoming", requests)
            # reading the ids alone is cheap; a request without its message is never written
            unmatched = con.execute(
                "SELECT count(*) FROM incoming ANTI JOIN "
                "(SELECT custom_id FROM read_parquet(?) WHERE user IS NOT NULL) USING (custom_id)",
                [str(messages)],
            ).fetchall()[0][0]
        if unmatched:  # the requests were read from this file: a bug if it happens
            raise LowtideError(
                f"{messages}: {unmatched} request(s) have no message in it (absent or null"
                "); nothing was written or sent. Run the job again: it rebuilds the "
                "file from the input"
            )
        name = message_files.keep(self.messages_dir, messages, run_id)
        with self.held():  # detached after each slice, its checkpoints cost a third more CPU
            self._insert_slices(requests, name, insert, run_id)

    def _insert_slices(
        self, requests: pl.DataFrame, message_file: str, insert: str, run_id: str
    ) -> None:
        with self._connect() as con:
            con.register("incoming", requests.select("custom_id"))
            stored = frame(
                con,
                "SELECT custom_id, message_file FROM requests WHERE line IS NULL "
                "AND user_message IS NULL AND custom_id IN (SELECT custom_id FROM incoming)",
            )
        # a request stored already whose message can no longer be read (its file lost or cut)
        # takes its message from this file: the same request, so the same message
        lost = message_files.unreadable(self.messages_dir, stored)
        if lost.len():
            with self._transaction() as con:
                con.register("lost", lost.to_frame())
                con.execute(
                    "UPDATE requests SET message_file = ? "
                    "WHERE custom_id IN (SELECT custom_id FROM lost)",
                    [message_file],
                )
        for part in requests.iter_slices(INSERT_SLICE_ROWS):
            with self._transaction() as con:
                con.register("incoming", part)
                con.execute(
                    insert + ", ?::VARCHAR AS message_file FROM incoming" + _NOT_STORED,
                    [run_id, message_file],
                )
            crash_point("mid_manifest")

    def save_template(self, template_id: str, head: str, mid: str, tail: str) -> None:
        with self._transaction() as con:
            con.execute(
                "INSERT OR IGNORE INTO request_templates VALUES (?, ?, ?, ?)",
                [template_id, head, mid, tail],
            )

    def has_manifest(self, run_id: str) -> bool:
        return bool(self._scalar("SELECT count(*) FROM batches WHERE run_id = ?", [run_id]))

    def next_attempt(self, run_id: str) -> int:
        """The attempt number of the run's next retry round."""
        return int(
            self._scalar(
                "SELECT coalesce(max(attempt), 1) + 1 FROM batches WHERE run_id = ?", [run_id]
            )
        )

    # -- batches by purpose ----------------------------------------------------------------------
    def run_batches(self, run_id: str) -> pl.DataFrame:
        return self._query(
            "SELECT * FROM batches WHERE run_id = ? ORDER BY shard, attempt", [run_id]
        )

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._query("SELECT * FROM batches WHERE batch_id = ?", [batch_id]).row(
            0, named=True
        )

    def unsent_provider_batches(self, run_id: str) -> list[str]:
        """Provider batches of the run that have no provider id yet, in sending order."""
        return self._ids(
            "SELECT batch_id FROM batches WHERE run_id = ? AND provider_batch_id IS NULL "
            "AND backend <> ? AND list_contains(?, status) ORDER BY attempt, shard, batch_id",
            [run_id, REALTIME_BACKEND, sql_list(UNSENT)],
        )

    def pending_realtime_batches(self, run_id: str) -> list[str]:
        return self._ids(
            "SELECT batch_id FROM batches WHERE run_id = ? AND backend = ? AND status = ? "
            "ORDER BY created_at",
            [run_id, REALTIME_BACKEND, BatchStatus.PENDING.value],
        )

    def uncollected_shards(self, run_id: str) -> list[str]:
        """Shards of a streaming backend still to stream (new, or cut off by a crash), in
        sending order (attempt, shard)."""
        return self._ids(
            "SELECT batch_id FROM batches WHERE run_id = ? AND backend <> ? AND NOT collected "
            "AND NOT list_contains(?, status) ORDER BY attempt, shard",
            [run_id, REALTIME_BACKEND, sql_list(TERMINAL)],
        )

    def ended_uncollected_batches(self, run_id: str) -> list[str]:
        """Ended batches still to join: the run's own and those it carries (see open_batches)."""
        return self._ids(
            f"SELECT batch_id FROM batches WHERE (run_id = $run OR batch_id IN ({_CARRIED})) "
            "AND NOT collected AND list_contains($terminal, status) "
            "ORDER BY created_at, attempt, shard",
            {"run": run_id, "terminal": sql_list(TERMINAL)},
        )

    def open_batches(self, run_id: str) -> pl.DataFrame:
        """Batches not yet collected that hold the run's requests: its own, and another run's
        that its dedupe attached to (a request already in flight is not sent again, so this run
        waits for and collects that batch too, even when nobody drives the other run)."""
        return self._query(
            f"SELECT * FROM batches WHERE NOT collected AND (run_id = $run "
            f"OR batch_id IN ({_CARRIED})) ORDER BY created_at, shard",
            {"run": run_id},
        )

    def live_provider_batches(self, run_id: str) -> pl.DataFrame:
        """(batch_id, provider_batch_id, status) of the run's batches the provider is still
        working on."""
        return self._query(
            "SELECT batch_id, provider_batch_id, status FROM batches WHERE run_id = ? "
            "AND provider_batch_id IS NOT NULL AND NOT list_contains(?, status)",
            [run_id, sql_list(TERMINAL)],
        )

    def claimed_provider_ids(self) -> tuple[str, ...]:
        """Every provider batch id already recorded, and every one refused for the provider's
        quota (crash repair must not adopt these)."""
        return tuple(
            self._query(
                "SELECT provider_batch_id FROM batches WHERE provider_batch_id IS NOT NULL "
                "UNION ALL SELECT provider_batch_id FROM quota_refusals "
                "WHERE provider_batch_id IS NOT NULL"
            )["provider_batch_id"].to_list()
        )

    def _ids(self, sql: str, params: list[Any] | dict[str, Any]) -> list[str]:
        return self._query(sql, params)["batch_id"].to_list()

    # -- batch transitions -----------------------------------------------------------------------
    def _batch(self, batch_id: str, **fields: Any) -> None:
        sets = self._set_clause("batches", fields)
        with self._transaction() as con:
            con.execute(
                f"UPDATE batches SET {sets}, updated_at = now() WHERE batch_id = ?",
                [*fields.values(), batch_id],
            )

    def record_uploaded(self, batch_id: str, input_file_id: str | None) -> None:
        """From here on a create call may happen: a restart looks for the batch first."""
        self._batch(batch_id, input_file_id=input_file_id, status=BatchStatus.UPLOADED.value)

    def record_created(self, batch_id: str, provider_batch_id: str) -> None:
        """The provider accepted the batch: its requests count as sent (`sent_at`)."""
        self._batch(
            batch_id,
            provider_batch_id=provider_batch_id,
            status=BatchStatus.VALIDATING.value,
            sent_at=_sent_now(),
        )

    def record_polls(self, observations: list[tuple[str, Any]]) -> None:
        """Store one poll round's observations (batch id, `BatchState`) in one transaction:
        a round over many batches opens the state file once, not once per batch."""
        if not observations:
            return
        fields = [_poll_fields(state) for _, state in observations]
        sets = self._set_clause("batches", fields[0])
        with self._transaction() as con:
            for (batch_id, _), values in zip(observations, fields, strict=True):
                con.execute(
                    f"UPDATE batches SET {sets}, updated_at = now() WHERE batch_id = ?",
                    [*values.values(), batch_id],
                )

    def fail_batch(self, batch_id: str, code: str, message: str) -> None:
        """The batch ended without being answered (refused, interrupted); its requests end
        failed with this reason when it is collected."""
        self._batch(batch_id, status=BatchStatus.FAILED.value, errors=_errors_json(code, message))

    def start_batch(self, batch_id: str) -> None:
        """Realtime and pool batches: answering has begun (its requests count as sent)."""
        self._batch(batch_id, status=BatchStatus.IN_PROGRESS.value, sent_at=_sent_now())

    def unstart_batch(self, batch_id: str) -> None:
        """A realtime batch the provider refused for the key, not for its requests: back to
        pending, unsent, for the next run with a working key to send."""
        self._batch(batch_id, status=BatchStatus.PENDING.value, sent_at=None)

    def complete_batch(self, batch_id: str) -> None:
        """Realtime and pool batches: every answer is stored."""
        self._batch(batch_id, status=BatchStatus.COMPLETED.value, collected=True)

    def mark_collected(self, batch_id: str) -> None:
        self._batch(batch_id, collected=True)

    def cancel_unsent_batches(self, run_id: str, keep_uploaded: bool = False) -> int:
        """Batches of a cancelled run that never reached the provider end cancelled.
        `keep_uploaded`: leave those whose create call may have reached it (`uploaded`), for
        the caller to look up first."""
        unsent = self.unsent_provider_batches(run_id) + self.pending_realtime_batches(run_id)
        if keep_uploaded:
            unsent = [b for b in unsent if self.batch(b)["status"] != BatchStatus.UPLOADED.value]
        for batch_id in unsent:
            self._batch(
                batch_id,
                status=BatchStatus.CANCELLED.value,
                errors=_errors_json("cancelled", "cancelled before it was sent"),
            )
        return len(unsent)

    def batch_members(self, batch_id: str) -> pl.DataFrame:
        return self._query("SELECT custom_id FROM batch_requests WHERE batch_id = ?", [batch_id])
