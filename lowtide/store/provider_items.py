"""What batches left at their provider: files (OpenAI) and ended batches (Anthropic), with
their sizes and whether lowtide deleted them (`provider_items`, migration 21).

A batch is released once its results are stored (`collected`): what the provider keeps of it
is then deleted, or kept when the job says so, and `batches.released_at` records that this was
done. A failed delete leaves its item here with the reason, still counted as left at the
provider (`left_at_provider`), for `lowtide leftovers` to delete later. A file that another
batch not yet collected also names is never handed out for release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from lowtide.store._db import Database
from lowtide.vocabulary import IN_FLIGHT_RUN, REALTIME_BACKEND, sql_list

_IN_USE = """
    SELECT unnest([input_file_id, output_file_id, error_file_id, provider_batch_id]) AS id
    FROM batches WHERE NOT collected
"""
"""Every provider id a batch not yet collected still needs."""


def _unless_in_use(column: str) -> str:
    return (
        f"CASE WHEN b.{column} IN (SELECT id FROM in_use WHERE id IS NOT NULL) "
        f"THEN NULL ELSE b.{column} END AS {column}"
    )


_REFS = ", ".join(
    _unless_in_use(c)
    for c in ("provider_batch_id", "input_file_id", "output_file_id", "error_file_id")
)

_UPSERT = """
    INSERT INTO provider_items (provider_id, batch_id, role, bytes, kept, deleted_at, gone_at,
                                delete_error, recorded_at)
    VALUES ($id, $batch, $role, $bytes, $kept, CASE WHEN $deleted THEN now() END,
            CASE WHEN $gone THEN now() END, $error, now())
    ON CONFLICT (provider_id) DO UPDATE SET
        bytes = coalesce(EXCLUDED.bytes, bytes),
        kept = EXCLUDED.kept,
        deleted_at = coalesce(deleted_at, EXCLUDED.deleted_at),
        gone_at = coalesce(gone_at, EXCLUDED.gone_at),
        delete_error = EXCLUDED.delete_error,
        recorded_at = EXCLUDED.recorded_at
"""


class ProviderItemsStore(Database):
    def unreleased_batches(self, run_id: str, batch_ids: Sequence[str] = ()) -> pl.DataFrame:
        """Collected provider batches of the run (and those in `batch_ids`, which a collect
        pass of the run stored) whose provider items were not dealt with yet: (batch_id,
        provider_batch_id, input_file_id, output_file_id, error_file_id), oldest first. An id
        that a batch not yet collected still needs reads as NULL."""
        return self._query(
            f"WITH in_use AS ({_IN_USE}) SELECT b.batch_id, {_REFS} FROM batches b "
            "WHERE b.collected AND b.released_at IS NULL AND b.backend <> $realtime "
            "AND (b.provider_batch_id IS NOT NULL OR b.input_file_id IS NOT NULL) "
            "AND (b.run_id = $run OR list_contains($ids::VARCHAR[], b.batch_id)) "
            "ORDER BY b.created_at, b.attempt, b.shard",
            {"run": run_id, "ids": list(batch_ids), "realtime": REALTIME_BACKEND},
        )

    def record_items(self, items: Sequence[dict[str, Any]], released: Sequence[str] = ()) -> None:
        """What lowtide learned of items at the provider, in one transaction: each item's
        `provider_id`, `batch_id`, `role`, `bytes`, `kept`, `deleted` (lowtide deleted it),
        `gone` (found gone without deleting it) and `error` (why a delete failed; None clears
        it). The batches in `released` are marked dealt with."""
        if not items and not released:
            return
        with self._transaction() as con:
            for item in items:
                con.execute(
                    _UPSERT,
                    {
                        "id": item["provider_id"],
                        "batch": item["batch_id"],
                        "role": str(item["role"]),
                        "bytes": item.get("bytes"),
                        "kept": bool(item.get("kept")),
                        "deleted": bool(item.get("deleted")),
                        "gone": bool(item.get("gone")),
                        "error": item.get("error"),
                    },
                )
            if released:
                con.execute(
                    "UPDATE batches SET released_at = now() "
                    "WHERE list_contains(?::VARCHAR[], batch_id)",
                    [list(released)],
                )

    def job_batch_refs(self, job: str, backend: str) -> pl.DataFrame:
        """Every provider batch of the job's runs on `backend`, sent or not (an upload a crash
        kept from the state file is found by the batch's id): its recorded ids, whether it is
        `live` (its run is in flight and its results are not stored yet) and `created_s` (unix
        seconds)."""
        return self._query(
            "SELECT b.batch_id, b.run_id, b.provider_batch_id, b.input_file_id, "
            "b.output_file_id, b.error_file_id, "
            "(NOT b.collected AND list_contains($in_flight, r.status)) AS live, "
            "epoch(b.created_at) AS created_s "
            "FROM batches b JOIN runs r USING (run_id) "
            "WHERE r.job = $job AND r.backend = $backend AND b.backend <> $realtime "
            "ORDER BY b.created_at, b.attempt, b.shard",
            {
                "job": job,
                "backend": backend,
                "in_flight": sql_list(IN_FLIGHT_RUN),
                "realtime": REALTIME_BACKEND,
            },
        )

    def recorded_items(self, batch_ids: Sequence[str]) -> pl.DataFrame:
        """The items recorded for these batches that lowtide neither deleted nor found gone."""
        return self._query(
            "SELECT provider_id, batch_id, role, bytes, kept, delete_error FROM provider_items "
            "WHERE deleted_at IS NULL AND gone_at IS NULL "
            "AND list_contains(?::VARCHAR[], batch_id) ORDER BY recorded_at, provider_id",
            [list(batch_ids)],
        )

    def left_at_provider(self, run_id: str | None = None) -> dict[str, dict[str, int]]:
        """Per run: how many items its batches left at the provider (`count`: kept by the job,
        or a delete that failed) and their size in bytes as the provider reported it (`bytes`;
        an Anthropic batch reports none)."""
        found = self._query(
            "SELECT b.run_id, count(*) AS count, coalesce(sum(p.bytes), 0) AS bytes "
            "FROM provider_items p JOIN batches b USING (batch_id) "
            "WHERE p.deleted_at IS NULL AND p.gone_at IS NULL "
            "AND ($run IS NULL OR b.run_id = $run) GROUP BY b.run_id",
            {"run": run_id},
        )
        return {
            r["run_id"]: {"count": int(r["count"]), "bytes": int(r["bytes"])}
            for r in found.iter_rows(named=True)
        }
