"""Provider queues: the limits lowtide was told or learned per provider and model, what it has
in flight there, and the batches a provider refused for its quota (`lowtide/quota.py` decides
from these whether the next batch may go).

A refused batch executed nothing and is not a failure of its requests: its lowtide batch goes
back to be created again (its uploaded input file kept), and the refused provider id is kept
apart so crash repair never adopts it.
"""

from __future__ import annotations

from datetime import timedelta

import orjson
import polars as pl

from lowtide.quota import ALL_MODELS, HOUR_S, QueueUsage
from lowtide.store._db import frame
from lowtide.store.manifest import ManifestStore
from lowtide.store.runs import now
from lowtide.vocabulary import REALTIME_BACKEND, TERMINAL, UNSENT, BatchStatus, sql_list

_UNADMITTED = sql_list(frozenset({BatchStatus.UPLOADED, BatchStatus.VALIDATING}))


class LimitsStore(ManifestStore):
    def provider_limits(self, provider: str, model: str) -> dict[str, float]:
        """Every remembered limit of `provider` for `model`, and those of all its models."""
        rows = self._query(
            "SELECT name, value FROM provider_limits WHERE provider = ? AND model IN (?, ?) "
            "ORDER BY model = ? ",  # the model's own row last, so it wins
            [provider, model, ALL_MODELS, model],
        )
        return dict(zip(rows["name"].to_list(), rows["value"].to_list(), strict=True))

    def learn_limit(self, provider: str, model: str, name: str, value: float, source: str) -> None:
        """Remember a limit (or a wait, `not_before`) for the next batch and the next night."""
        with self._transaction() as con:
            con.execute(
                "INSERT OR REPLACE INTO provider_limits VALUES (?, ?, ?, ?, ?, ?)",
                [provider, model, name, float(value), source, now()],
            )

    def queue_usage(self, provider: str, model: str) -> QueueUsage:
        """What every run of this state file has in flight at `provider`: tokens and unadmitted
        batches of `model`, requests of all models, and creates in the last hour (refused ones
        included: the provider counted them)."""
        since = now() - timedelta(seconds=HOUR_S)
        row = self._query(
            "SELECT coalesce(sum(b.est_tokens) FILTER (WHERE r.model = $model), 0) AS tokens, "
            "coalesce(sum(b.n_requests), 0) AS requests, "
            "count(*) FILTER (WHERE r.model = $model AND list_contains($unadmitted, b.status)) "
            "AS unadmitted "
            "FROM batches b JOIN runs r USING (run_id) WHERE b.backend = $provider "
            "AND b.provider_batch_id IS NOT NULL AND NOT list_contains($terminal, b.status)",
            {
                "model": model,
                "provider": provider,
                "unadmitted": _UNADMITTED,
                "terminal": sql_list(TERMINAL),
            },
        ).row(0, named=True)
        creates = self._scalar(
            "SELECT (SELECT count(*) FROM batches WHERE backend = $1 AND provider_batch_id IS NOT "
            "NULL AND sent_at >= $2) + (SELECT count(*) FROM quota_refusals WHERE provider = $1 "
            "AND refused_at >= $2)",
            [provider, since],
        )
        return QueueUsage(
            tokens=int(row["tokens"]),
            requests=int(row["requests"]),
            unadmitted=int(row["unadmitted"]),
            creates_last_hour=int(creates or 0),
        )

    def requeue_refused(
        self, batch_id: str, provider: str, model: str, reason: str, queued_tokens: int
    ) -> None:
        """The provider refused the batch for its quota (it ran nothing): keep the refused id
        apart and put the batch back to be created again, with its uploaded file, once the
        queue holds fewer than `queued_tokens` (what else it held when it refused)."""
        with self._transaction() as con:
            con.execute(
                "INSERT INTO quota_refusals SELECT batch_id, run_id, ?, ?, provider_batch_id, ?, "
                "?, ? FROM batches WHERE batch_id = ?",
                [provider, model, reason, now(), queued_tokens, batch_id],
            )
            con.execute(
                "UPDATE batches SET status = CASE WHEN input_file_id IS NULL THEN ? ELSE ? END, "
                "provider_batch_id = NULL, provider_status = NULL, output_file_id = NULL, "
                "error_file_id = NULL, result_ref = NULL, request_counts = NULL, errors = NULL, "
                "usage = NULL, updated_at = now() WHERE batch_id = ?",
                [BatchStatus.PENDING.value, BatchStatus.UPLOADED.value, batch_id],
            )

    def quota_refusals(self, run_id: str) -> int:
        """How many times the provider refused one of the run's batches for its quota."""
        return int(
            self._scalar("SELECT count(*) FROM quota_refusals WHERE run_id = ?", [run_id]) or 0
        )

    def unsent_batch_sizes(self, run_id: str) -> pl.DataFrame:
        """(batch_id, n_requests, est_tokens, wait_below) of the run's provider batches not
        created yet, in sending order; `wait_below` is set for a batch the provider refused for
        its quota: what else the queue held then (it goes again once the queue holds less)."""
        return self._query(
            "SELECT b.batch_id, b.n_requests, coalesce(b.est_tokens, 0) AS est_tokens, "
            "(SELECT min(q.queued_tokens) FROM quota_refusals q WHERE q.batch_id = b.batch_id) "
            "AS wait_below FROM batches b "
            "WHERE b.run_id = ? AND b.provider_batch_id IS NULL AND b.backend <> ? "
            "AND list_contains(?, b.status) ORDER BY b.attempt, b.shard, b.batch_id",
            [run_id, REALTIME_BACKEND, sql_list(UNSENT)],
        )

    def split_batch(self, batch_id: str, max_tokens: int) -> list[str]:
        """Cut an unsent batch whose estimated tokens exceed what the provider's queue holds
        into batches of at most `max_tokens` (its requests in custom_id order), in place of it;
        returns the new batch ids (`<batch_id>-p<k>`), in sending order. One transaction: a
        crash leaves the old batch or the new ones, never both."""
        old = self.batch(batch_id)
        with self._transaction() as con:
            parts = frame(
                con,
                "WITH m AS (SELECT br.custom_id, coalesce(r.est_input_tokens, 0) AS t "
                "FROM batch_requests br JOIN requests r USING (custom_id) WHERE br.batch_id = ?), "
                "c AS (SELECT custom_id, t, sum(t) OVER (ORDER BY custom_id) - t AS before, "
                "max(t) OVER () AS widest FROM m) "
                "SELECT custom_id, t, CAST(floor(before / greatest(? - widest, widest, 1)) "
                "AS INTEGER) AS part FROM c",
                [batch_id, max_tokens],
            )
            pieces = (
                parts.group_by("part")
                .agg(pl.len().alias("n"), pl.col("t").sum().alias("tokens"))
                .sort("part")
            )
            ids = [f"{batch_id}-p{p}" for p in pieces["part"].to_list()]
            share = old["n_bytes"] / max(old["n_requests"], 1)
            rows = pl.DataFrame(
                {
                    "batch_id": ids,
                    "n": pieces["n"],
                    "tokens": pieces["tokens"],
                }
            ).with_columns((pl.col("n") * share).round().cast(pl.Int64).alias("bytes"))
            con.register("pieces", rows)
            con.register("parts", parts)
            con.execute(
                "INSERT INTO batches BY NAME SELECT batch_id, $run AS run_id, $shard AS shard, "
                "$attempt AS attempt, $backend AS backend, $pending AS status, n AS n_requests, "
                "bytes AS n_bytes, tokens AS est_tokens, false AS collected, "
                "now() AS created_at, now() AS updated_at FROM pieces",
                {
                    "run": old["run_id"],
                    "shard": old["shard"],
                    "attempt": old["attempt"],
                    "backend": old["backend"],
                    "pending": BatchStatus.PENDING.value,
                },
            )
            con.execute(
                "UPDATE batch_requests SET batch_id = $old || '-p' || CAST(parts.part AS VARCHAR) "
                "FROM parts WHERE batch_requests.batch_id = $old "
                "AND batch_requests.custom_id = parts.custom_id",
                {"old": batch_id},
            )
            con.execute("DELETE FROM batches WHERE batch_id = ?", [batch_id])
            con.unregister("pieces")
            con.unregister("parts")
        return ids

    def expire_unsent_batches(self, run_id: str, reason: str) -> int:
        """Batches of the run still waiting for room at the provider when the run's deadline
        passed end expired with `reason`: their requests take the stragglers' path (the realtime
        fallback where the backend has one)."""
        unsent = self.unsent_provider_batches(run_id)
        for batch_id in unsent:
            self._batch(
                batch_id,
                status=BatchStatus.EXPIRED.value,
                errors=orjson.dumps([{"code": "queue_full", "message": reason}]).decode(),
            )
        return len(unsent)
