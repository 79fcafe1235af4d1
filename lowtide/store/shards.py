"""The write-ahead manifest of `vllm run-batch` shards (backend `vllm-run-batch`).

A shard is a `batches` row of the run's backend whose `input_file_id` (its input file's URL) was
set when the row was written, before the file; `output_file_id` is where run-batch writes its
answers. A *planned* batch (from assemble or a retry round) has no input file: the export
replaces it by shards in one transaction, which is safe because nothing outside the state file
has seen it. A shard's life, in the one batch vocabulary:

    pending (row written, file not yet) → in_progress (file written, `runbatch:` id stored)
      → completed + collected (every member has its output line, imported)
      → expired + collected (it stopped short; the next export took its unanswered requests)
"""

from __future__ import annotations

import polars as pl

from lowtide.store import Store, now
from lowtide.store._db import frame
from lowtide.vocabulary import ANSWERED, TERMINAL, BatchStatus, sql_list

_RUN_BACKEND = "(SELECT backend FROM runs WHERE run_id = $run)"


class ShardStore(Store):
    """`Store` plus the queries of the shard export and import."""

    def shards(self, run_id: str) -> pl.DataFrame:
        """The run's shards, every export round, in writing order."""
        return self._query(
            "SELECT batch_id, shard, attempt, status, collected, provider_batch_id, "
            "input_file_id, output_file_id, n_requests FROM batches "
            f"WHERE run_id = $run AND backend = {_RUN_BACKEND} AND input_file_id IS NOT NULL "
            "ORDER BY created_at, shard",
            {"run": run_id},
        )

    def planned_batches(self, run_id: str) -> pl.DataFrame:
        """(batch_id, attempt) of the run's batches that no export has written yet."""
        return self._query(
            "SELECT batch_id, attempt FROM batches "
            f"WHERE run_id = $run AND backend = {_RUN_BACKEND} AND input_file_id IS NULL "
            "AND NOT collected AND NOT list_contains($terminal, status) ORDER BY attempt, shard",
            {"run": run_id, "terminal": sql_list(TERMINAL)},
        )

    def unanswered_members(self, batch_ids: list[str]) -> pl.DataFrame:
        """(batch_id, custom_id) of these batches' requests that still need an answer: none is
        stored, and this batch itself gave none (an error line it returned is final)."""
        with self._connect() as con:
            con.register("wanted", pl.DataFrame({"batch_id": batch_ids}, schema={"batch_id": str}))
            return frame(
                con,
                "SELECT br.batch_id, br.custom_id FROM batch_requests br JOIN wanted USING "
                "(batch_id) LEFT JOIN results r USING (custom_id) WHERE r.custom_id IS NULL OR "
                "(NOT list_contains($answered, r.outcome) AND r.batch_id <> br.batch_id) "
                "ORDER BY br.batch_id, br.custom_id",
                {"answered": list(ANSWERED)},
            )

    def pending_requests(self, run_id: str) -> int:
        """Requests of the run's open batches (planned or shards) with no answer yet."""
        return int(
            self._scalar(
                "SELECT count(DISTINCT br.custom_id) FROM batch_requests br "
                "JOIN batches b USING (batch_id) LEFT JOIN results r USING (custom_id) "
                "WHERE b.run_id = ? AND NOT b.collected "
                "AND (r.custom_id IS NULL OR NOT list_contains(?, r.outcome))",
                [run_id, list(ANSWERED)],
            )
        )

    def write_shard_manifest(
        self,
        run_id: str,
        *,
        retire: list[str],
        stopped: dict[str, str],
        batches: pl.DataFrame,
        members: pl.DataFrame,
    ) -> None:
        """One export round, in one transaction, before any file is written: the planned
        batches `retire` are replaced, the `stopped` shards (batch_id → what happened) end
        expired and collected, and the new shard rows (`pending`, with their file URLs) and
        members are written."""
        with self._transaction() as con:
            con.register("retired", pl.DataFrame({"batch_id": retire}, schema={"batch_id": str}))
            con.register("bat", batches)
            con.register("mem", members)
            con.execute("DELETE FROM batch_requests WHERE batch_id IN (SELECT * FROM retired)")
            con.execute("DELETE FROM batches WHERE batch_id IN (SELECT * FROM retired)")
            for batch_id, note in stopped.items():
                con.execute(
                    "UPDATE batches SET status = ?, provider_status = ?, collected = true, "
                    "updated_at = now() WHERE batch_id = ?",
                    [BatchStatus.EXPIRED.value, note, batch_id],
                )
            con.execute(
                "INSERT INTO batches BY NAME SELECT batch_id, ?::VARCHAR AS run_id, shard, "
                "attempt, backend, ? AS status, input_file_id, output_file_id, n_requests, "
                "n_bytes, false AS collected, now() AS created_at, now() AS updated_at FROM bat",
                [run_id, BatchStatus.PENDING.value],
            )
            # no key on batch_requests (migration 16): a plan names each request once, and a
            # batch row that exists already refuses this whole transaction
            con.execute("INSERT INTO batch_requests SELECT batch_id, custom_id FROM mem")

    def record_shard_written(self, batch_id: str, provider_batch_id: str) -> None:
        """The shard's input file is complete: from here on a runner may answer it."""
        self._batch(
            batch_id,
            provider_batch_id=provider_batch_id,
            status=BatchStatus.IN_PROGRESS.value,
            sent_at=now(),
        )
