"""reconcile: provider-reported usage × the dated price table → the run's cost ledger and numbers.

Every billed request gets its own price (batch price with the cached-input rate, or list price
for the realtime channel); the `costs` rows per batch and per run are sums of those, so they add
up to the cent. The realtime counterfactual prices the same tokens at list price; savings are
broken down into the batch discount, dedupe (units that shared a request) and cache hits
(requests answered in earlier runs). Where the provider reports batch-level usage, it is kept
beside lowtide's own sum and any difference is a metric.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
import polars as pl

from lowtide.context import RunContext
from lowtide.orchestration import task
from lowtide.pricing import Price
from lowtide.runlog import stage_log
from lowtide.vocabulary import ANSWERED, REALTIME_BACKEND, Channel

_TOKENS = ("input_tokens", "cached_tokens", "output_tokens")


def request_costs(results: pl.DataFrame, price: Price) -> pl.DataFrame:
    """Add `cost_usd` (as billed) and `realtime_usd` (list price) to each result row."""
    tok = {c: pl.col(c).fill_null(0) for c in _TOKENS}
    list_usd = (
        (tok["input_tokens"] - tok["cached_tokens"]).clip(lower_bound=0) * price.input
        + tok["cached_tokens"] * price.cached_input
        + tok["output_tokens"] * price.output
    ) / 1e6
    channel = pl.col("channel").fill_null(Channel.BATCH.value)
    # a pool's requests were priced by GPU time when they ran (tasks/stream.py)
    pooled = pl.col("cost_usd").fill_null(0.0) if "cost_usd" in results.columns else pl.lit(0.0)
    return results.with_columns(
        pl.when(channel == Channel.POOL.value)
        .then(pooled)
        .when(channel == Channel.BATCH.value)
        .then(list_usd * price.batch_discount)
        .otherwise(list_usd)
        .alias("cost_usd"),
        pl.when(channel == Channel.POOL.value)
        .then(pooled)
        .otherwise(list_usd)
        .alias("realtime_usd"),
    )


def _provider_usage(batches: pl.DataFrame) -> pl.DataFrame:
    rows = []
    for b in batches.iter_rows(named=True):
        usage = orjson.loads(b["usage"]) if b.get("usage") else None
        rows.append(
            {
                "batch_id": b["batch_id"],
                "provider_input_tokens": usage.get("input_tokens") if usage else None,
                "provider_output_tokens": usage.get("output_tokens") if usage else None,
            }
        )
    return pl.DataFrame(
        rows,
        schema={
            "batch_id": pl.String,
            "provider_input_tokens": pl.Int64,
            "provider_output_tokens": pl.Int64,
        },
    )


def cost_rows(
    priced: pl.DataFrame, provider: pl.DataFrame, price: Price, backend: str, estimate: float | None
) -> pl.DataFrame:
    """One `batch` row per batch and one `run` row, each a sum of per-request prices."""
    sums = [
        pl.len().alias("requests"),
        *[pl.col(c).fill_null(0).sum() for c in _TOKENS],
        pl.col("cost_usd").sum(),
        pl.col("realtime_usd").sum().alias("realtime_cost_usd"),
    ]
    per_batch = (
        priced.group_by("batch_id", maintain_order=True)
        .agg(sums)
        .join(provider, on="batch_id", how="left")
        .with_columns(
            pl.lit("batch").alias("level"), pl.lit(None, pl.Float64).alias("estimate_usd")
        )
    )
    reported = provider.filter(pl.col("batch_id").is_in(priced["batch_id"].unique().implode()))
    complete = reported.height and reported["provider_input_tokens"].null_count() == 0
    run = priced.select(sums).with_columns(
        pl.lit("run").alias("level"),
        pl.lit("").alias("batch_id"),
        pl.lit(estimate, pl.Float64).alias("estimate_usd"),
        pl.lit(int(reported["provider_input_tokens"].sum()) if complete else None, pl.Int64).alias(
            "provider_input_tokens"
        ),
        pl.lit(int(reported["provider_output_tokens"].sum()) if complete else None, pl.Int64).alias(
            "provider_output_tokens"
        ),
    )
    return pl.concat([run, per_batch], how="diagonal_relaxed").with_columns(
        pl.lit(backend).alias("backend"),
        pl.lit(price.model).alias("model"),
        pl.lit(price.effective_date).alias("price_date"),
    )


def savings(outcomes: pl.DataFrame, price: Price) -> dict[str, float]:
    """Realtime dollars not spent thanks to dedupe and to the cross-run cache: the list price
    of the tokens that extra units sharing a request, and cache-hit requests, would have cost."""
    rows = outcomes.filter((pl.col("kind") == "row") & (pl.col("custom_id") != ""))
    dup = rows.filter(~pl.col("custom_id").is_first_distinct())  # every unit after the first
    cached = rows.filter(pl.col("cache_hit")).unique(subset="custom_id")

    def listed(frame: pl.DataFrame) -> float:
        if frame.is_empty():
            return 0.0
        return float(
            request_costs(frame.with_columns(pl.lit("realtime").alias("channel")), price)[
                "realtime_usd"
            ].sum()
        )

    return {"dedupe_savings_usd": listed(dup), "cache_savings_usd": listed(cached)}


def _number(value: Any) -> float | None:
    """A polars aggregate as a float (None for an empty or all-null column)."""
    return None if value is None else float(value)


def _minutes_since(started: datetime | None) -> float | None:
    if started is None:
        return None
    return max((datetime.now(UTC).replace(tzinfo=None) - started).total_seconds() / 60, 1e-9)


@task(name="reconcile", task_run_name="reconcile-{run_id}")
def reconcile_task(ctx: RunContext, run_id: str) -> dict:
    """Price every request the run was billed for, write its `costs` and `metrics`, and return
    the run's cost, its billed tokens at realtime price, and the naive counterfactual (realtime
    price with no dedupe and no cache)."""
    store, price = ctx.store, ctx.price
    run = store.require_run(run_id)
    stored = store.billed_results(run_id)
    billed = request_costs(stored, price)
    # most were priced as parse stored them: only a price missing or different is written
    store.set_result_costs(billed.filter(pl.col("cost_usd").ne_missing(stored["cost_usd"])))
    batches = store.run_batches(run_id)
    costs = cost_rows(billed, _provider_usage(batches), price, ctx.backend, run.get("estimate_usd"))
    store.replace_rows("costs", run_id, costs)
    run_cost = costs.filter(pl.col("level") == "run").row(0, named=True)
    outcomes = store.run_unit_usage(run_id)  # sums
    minutes = _minutes_since(run.get("started_at"))
    answered_here = billed.filter(pl.col("outcome").is_in(ANSWERED))
    sent = billed.height
    ended = batches.filter(pl.col("backend") != REALTIME_BACKEND)
    durations = (
        (ended["updated_at"] - ended["created_at"]).dt.total_seconds() if ended.height else None
    )
    rows = outcomes.filter(pl.col("kind") == "row")
    mismatch = None
    if run_cost["provider_input_tokens"] is not None:
        mismatch = abs(run_cost["provider_input_tokens"] - run_cost["input_tokens"]) + abs(
            (run_cost["provider_output_tokens"] or 0) - run_cost["output_tokens"]
        )
    metrics = {
        "completions_per_minute": answered_here.height / minutes if minutes else None,
        "failure_rate": _number(rows["outcome"].is_in(ANSWERED).not_().mean()) or 0.0,
        "retry_rate": _number((billed["attempts"] > 1).mean()) or 0.0,
        "mean_context_tokens": _number(billed["input_tokens"].mean()),
        "max_output_tokens": _number(billed["output_tokens"].max()),
        "slowest_batch_s": _number(durations.max()) if durations is not None else None,
        "longest_unit_tokens": _number(rows["unit_tokens"].max()),
        "usage_mismatch_tokens": float(mismatch) if mismatch is not None else None,
        "batch_savings_usd": run_cost["realtime_cost_usd"] - run_cost["cost_usd"],
        **savings(outcomes, price),
    }
    store.replace_rows(
        "metrics",
        run_id,
        pl.DataFrame(
            {
                "name": list(metrics),
                "value": [None if v is None else float(v) for v in metrics.values()],
            },
            schema={"name": pl.String, "value": pl.Float64},
        ),
    )
    naive = (
        run_cost["realtime_cost_usd"]
        + (metrics["dedupe_savings_usd"] or 0.0)
        + (metrics["cache_savings_usd"] or 0.0)
    )
    stage_log(
        "reconcile",
        "%d requests billed, $%.4f (realtime price $%.4f; no dedupe, no cache $%.4f)",
        sent,
        run_cost["cost_usd"],
        run_cost["realtime_cost_usd"],
        naive,
    )
    return {
        "cost_usd": run_cost["cost_usd"],
        "realtime_cost_usd": run_cost["realtime_cost_usd"],
        "naive_cost_usd": naive,
        **{k: v for k, v in metrics.items() if v is not None},
    }
