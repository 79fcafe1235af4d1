"""reconcile: provider-reported usage × the dated price table → the run's cost ledger and numbers.

Actual cost uses the batch price (and the cached-input price for cached tokens). The realtime
counterfactual prices the same tokens at list price; savings are broken down into the batch
discount, dedupe (units that shared a request) and cache hits (requests answered in earlier runs).
"""

from __future__ import annotations

from datetime import UTC, datetime

import polars as pl
from prefect import task

from lowtide.pricing import Price
from lowtide.store.state import ANSWERED, Store

_TOKENS = ("input_tokens", "cached_tokens", "output_tokens")


def _priced(frame: pl.DataFrame, price: Price) -> tuple[float, float]:
    sums = {c: int(frame[c].fill_null(0).sum()) for c in _TOKENS}
    return (
        price.cost(sums["input_tokens"], sums["cached_tokens"], sums["output_tokens"], batch=True),
        price.cost(sums["input_tokens"], sums["cached_tokens"], sums["output_tokens"], batch=False),
    )


def cost_rows(
    billed: pl.DataFrame, price: Price, backend: str, estimate: float | None
) -> pl.DataFrame:
    """One `run` row and one row per batch, from the results this run paid for."""
    rows = []
    groups = [("run", "", billed)] + [
        ("batch", str(key[0]), part)
        for key, part in billed.group_by("batch_id", maintain_order=True)
    ]
    for level, batch_id, part in groups:
        cost, realtime = _priced(part, price)
        rows.append(
            {
                "level": level,
                "batch_id": batch_id,
                "backend": backend,
                "model": price.model,
                "requests": part.height,
                **{c: int(part[c].fill_null(0).sum()) for c in _TOKENS},
                "cost_usd": cost,
                "realtime_cost_usd": realtime,
                "estimate_usd": estimate if level == "run" else None,
                "price_date": price.effective_date,
            }
        )
    return pl.DataFrame(rows, schema_overrides={"estimate_usd": pl.Float64})


def savings(outcomes: pl.DataFrame, price: Price) -> dict[str, float]:
    """Realtime dollars not spent thanks to dedupe and to the cross-run cache."""
    rows = outcomes.filter(pl.col("kind") == "row").filter(pl.col("custom_id") != "")
    dup = rows.filter(pl.col("custom_id").is_duplicated()).filter(
        pl.int_range(pl.len()).over("custom_id") > 0
    )
    first_cached = rows.filter(pl.col("cache_hit")).unique(subset="custom_id")
    return {
        "dedupe_savings_usd": _priced(dup, price)[1],
        "cache_savings_usd": _priced(first_cached, price)[1],
    }


@task(name="reconcile", task_run_name="reconcile-{run_id}")
def reconcile_task(
    run_id: str, state_path: str, price: Price, backend: str, estimate_usd: float | None
) -> dict:
    store = Store(state_path)
    billed = store.query(
        "SELECT * FROM results WHERE run_id = ? AND input_tokens IS NOT NULL", [run_id]
    )
    costs = cost_rows(billed, price, backend, estimate_usd)
    store.replace_rows("costs", run_id, costs)
    run_cost = costs.filter(pl.col("level") == "run").row(0, named=True)
    outcomes = store.run_unit_outcomes(run_id)
    saved = savings(outcomes, price)
    run = store.get_run(run_id) or {}
    started = run.get("started_at")
    minutes = (
        max((datetime.now(UTC).replace(tzinfo=None) - started).total_seconds() / 60, 1e-9)
        if started
        else None
    )
    answered_here = billed.filter(pl.col("outcome").is_in(ANSWERED))
    sent = billed.height
    metrics = {
        "completions_per_minute": answered_here.height / minutes if minutes else None,
        "failure_rate": (
            outcomes.filter(pl.col("kind") == "row")["outcome"].is_in(ANSWERED).not_().mean()
            if outcomes.height
            else 0.0
        ),
        "retry_rate": float((billed["attempts"] > 1).mean()) if sent else 0.0,  # type: ignore[arg-type]
        "mean_context_tokens": float(billed["input_tokens"].mean()) if sent else None,  # type: ignore[arg-type]
        "max_output_tokens": float(billed["output_tokens"].max()) if sent else None,  # type: ignore[arg-type]
        "batch_savings_usd": run_cost["realtime_cost_usd"] - run_cost["cost_usd"],
        **saved,
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
    return {
        "cost_usd": run_cost["cost_usd"],
        "realtime_cost_usd": run_cost["realtime_cost_usd"],
        "input_tokens": run_cost["input_tokens"],
        "cached_tokens": run_cost["cached_tokens"],
        "output_tokens": run_cost["output_tokens"],
        **{k: v for k, v in metrics.items() if v is not None},
    }
