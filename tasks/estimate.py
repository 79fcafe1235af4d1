"""estimate: what a run of a job would send and cost, worked out before anything is paid.

The input is read, chunked and keyed exactly as a run does it (the same pure stage functions),
the state file says which requests earlier runs already answered (cache hits) or have in a live
batch, and what is left is priced on every backend whose price is known. Nothing is written: no
run, no state file (the cache is only asked when the file exists), no request sent, no Prefect
flow started.

The quote (`estimate_job`) is a plain dict; `lowtide estimate --json` prints it as it is:

- `rows`, `units` (row units after chunking), `eval_rows`, `unique_requests` (row and eval
  requests, as a run counts them), `cache_hits`, `in_flight` (attached to a live batch, not
  resent), `requests_to_send`, `urgent_requests` (`[input] priority_column`);
- `input_tokens`, `output_tokens`: estimated over the requests to send. Output per request is the
  mean the provider billed in the job's earlier runs when the state file has any
  (`output_tokens_source = "observed"`), else the few-shot answers' mean length (`"examples"`)
  or half of `[model] max_tokens` (`"max_tokens"`), as the run's budget guard counts it;
- `estimate_usd`: the chosen backend's cost (batch price, urgent requests at realtime price), or
  None when it has no price; `budget_usd` (`[cost] budget_usd`, or None) and `over_budget`;
- `by_backend`: backend name → `{"model", "batch_usd", "realtime_usd"}` for token-priced
  backends (the price table row of the model that backend would run), or a number (USD) for a
  GPU-hour priced pool; backends that cannot be priced are in `skipped` (name → why);
- `assumptions`: the figures taken on trust (e.g. the pool's tokens/s), as sentences;
- `prompt_cache`: what the chosen backend's prompt cache does with the stable prefix (the system
  prompt and few-shot examples every request repeats), or None for an engine priced by GPU time:
  `prefix_tokens` (counted as the input tokens are), `provider` and `model` whose rules apply,
  `min_tokens` (the provider's minimum cacheable prompt for the model; None when lowtide does
  not know it), `cached` (the prefix reaches it), `cached_tokens_per_request` (read back by
  each request after the first), `saved_usd` (best case: one cache write, every later request
  reads; priced like `estimate_usd` with the price table's cached-input price; 0 when nothing is
  cached, None without a price). `estimate_usd` itself counts no cache reads;
- `route` (a job with `[route]`, quoted without `--backend`): `steps` (engine, model, `usd` for
  everything left to send on that engine), `best_usd` (the first engine answers all),
  `worst_usd` (the dearest engine of the route answers all) and `unpriced` engines. Rows another
  engine of the route already answered count as cache hits, as in the run.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from lowtide.backends import REGISTRY, BackendEntry, prompt_cache
from lowtide.errors import PriceError, PriceTableError
from lowtide.jobspec import JobSpec, load_job
from lowtide.planner import DEFAULT_TOKENS_PER_S
from lowtide.pricing import Price, load_price
from lowtide.settings import Settings
from lowtide.store import Store
from lowtide.tokens import count_tokens
from tasks.assemble import estimate_input_tokens, expected_output_tokens, fixed_messages
from tasks.chunk import job_units
from tasks.dedupe import carry_route_answers, key_units, unique_requests
from tasks.load import load_eval_set, load_input, mark_value

ESTIMATE_RUN_ID = "estimate"
"""Stands in for the run id in eval request keys: with `[qa] eval_every_run` they carry the run
id, so they are never cache hits, as in the run that follows."""


def model_name_for(job: JobSpec, backend: str) -> str:
    """The model `backend` would run for this job: `[model] names` for it, else `[model] name`."""
    if backend in job.model.names:
        return job.model.names[backend]
    if job.model.backend not in job.model.names:  # job.model.name is still `[model] name`
        return job.model.name
    return load_job(job.source_path, backend).model.name


def pool_cost_usd(job: JobSpec, settings: Settings, output_tokens: int) -> tuple[float, str]:
    """USD of `output_tokens` on the pool at `[pool] gpu_hour_usd` × `gpus` for the wall time
    the servers need at `[pool] tokens_per_s` each (the planner's default when unset), and the
    assumption as a sentence. Servers: LOWTIDE_VLLM_URLS or `[pool] urls`, else one per GPU."""
    pool = job.pool
    assert pool.gpu_hour_usd is not None
    urls = [u for u in (settings.vllm_urls or "").split(",") if u.strip()] or pool.urls
    servers = len(urls) or pool.gpus
    tps = pool.tokens_per_s or DEFAULT_TOKENS_PER_S
    wall_s = output_tokens / (tps * servers)
    source = "[pool] tokens_per_s" if pool.tokens_per_s else "the planner's default, unmeasured"
    note = (
        f"pool: {tps:g} output tokens/s per server ({source}), {servers} server(s), "
        f"{pool.gpus} GPU(s) at ${pool.gpu_hour_usd:g}/GPU-hour: {wall_s / 3600:.2f} h"
    )
    return wall_s / 3600 * pool.gpu_hour_usd * pool.gpus, note


def _token_price(job: JobSpec, entry: BackendEntry) -> Price:
    provider = entry.capabilities().price_provider
    return load_price(job.resolve(job.cost.price_table), provider, model_name_for(job, entry.name))


def _cache(
    job: JobSpec, settings: Settings, uniq: pl.DataFrame
) -> tuple[pl.DataFrame, float | None]:
    """(`answered`, `in_flight` per request; the observed mean output tokens per request) from
    the state file; all False / None when there is none (it is never created here)."""
    if not settings.state.is_file():
        return uniq.with_columns(answered=pl.lit(False), in_flight=pl.lit(False)), None
    store = Store(settings.state, settings.lock_timeout_s)
    known = store.known_outcomes(uniq["custom_id"])
    observed = store.observed_output_tokens(job.name)["mean"]
    joined = uniq.join(known, on="custom_id", how="left").with_columns(
        pl.col("answered").fill_null(False), pl.col("in_flight").fill_null(False)
    )
    return joined, None if observed is None else float(observed)


def _cursor_mark(job: JobSpec, settings: Settings) -> Any:
    """With `[input] cursor_column`, the mark the next run reads past (None: every row), so a
    quote prices what the run would read."""
    column = job.input.cursor_column
    if column is None or not settings.state.is_file():
        return None
    mark = Store(settings.state, settings.lock_timeout_s).cursor_mark(
        job.name,
        column=column,
        backend=REGISTRY[job.model.backend].name,
        job_fingerprint=job.prompt_fingerprint(),
    )
    return mark_value(mark)[1] if mark else None


def estimate_job(job: JobSpec, settings: Settings, backend: str | None = None) -> dict[str, Any]:
    """The quote for running `job` (on `backend`, default `[model] backend`); see the module
    docstring for its fields. Raises what a run would raise for bad input (InputError, …)."""
    if backend and backend != job.model.backend:
        job = load_job(job.source_path, backend)
    rows = load_input(job, _cursor_mark(job, settings))
    evals = load_eval_set(job)
    # texts a run (or an earlier quote) already cut are not tokenized again, and this quote's
    # cuts serve the run that follows it
    store = Store(settings.state, settings.lock_timeout_s) if settings.state.is_file() else None
    keyed = key_units(job, job_units(job, rows, evals, memo=store), ESTIMATE_RUN_ID)
    routed = job.route is not None and backend is None
    if routed and store is not None:  # rows another engine of the route answered
        keyed = carry_route_answers(store, job, keyed)
    uniq, observed = _cache(job, settings, unique_requests(keyed))
    to_send = uniq.filter(~pl.col("answered") & ~pl.col("in_flight"))
    n_send = to_send.height
    urgent = int(to_send["urgent"].sum()) if n_send else 0
    input_tokens = int(estimate_input_tokens(job, to_send).sum()) if n_send else 0
    expected = expected_output_tokens(job)
    per_request = float(expected) if observed is None else observed
    source = "examples" if job.prompt.examples else "max_tokens"
    if observed is not None:
        source = "observed"
    output_tokens = round(n_send * per_request)

    by_backend: dict[str, Any] = {}
    prices: dict[str, Price] = {}
    skipped: dict[str, str] = {}
    assumptions: list[str] = []
    for name, entry in REGISTRY.items():
        if entry.pricing == "gpu_hour":
            if job.pool.gpu_hour_usd is None:
                skipped[name] = "priced by GPU time: set [pool] gpu_hour_usd"
                continue
            by_backend[name], note = pool_cost_usd(job, settings, output_tokens)
            assumptions.append(note)
            continue
        try:
            price = _token_price(job, entry)
        except PriceTableError:
            raise
        except PriceError as e:
            skipped[name] = str(e)
            continue
        prices[name] = price
        by_backend[name] = {
            "model": price.model,
            "batch_usd": price.cost(input_tokens, 0, output_tokens, batch=True),
            "realtime_usd": price.cost(input_tokens, 0, output_tokens, batch=False),
        }

    chosen = REGISTRY[job.model.backend]
    quote = by_backend.get(chosen.name)
    estimate: float | None
    share = urgent / n_send if n_send and chosen.has_realtime else 0.0
    if isinstance(quote, dict):
        estimate = quote["batch_usd"] * (1 - share) + quote["realtime_usd"] * share
    else:
        estimate = quote
    cache = _prompt_cache_quote(job, chosen, prices.get(chosen.name), n_send, share)
    if cache is not None and cache["cached"]:
        assumptions.append(
            "prompt cache: one cache write, then every later request reads the prefix (a best "
            "case: batches run in parallel and providers cache on a best-effort basis)"
        )
    budget = job.cost.budget_usd
    route = _route_quote(job, by_backend) if routed else None
    return {
        **({"route": route} if route is not None else {}),
        "job": job.name,
        "backend": chosen.name,
        "model": job.model.name,
        "rows": rows.height,
        "units": int((keyed["kind"] == "row").sum()),
        "eval_rows": 0 if evals is None else evals.height,
        "unique_requests": uniq.height,
        "cache_hits": int(uniq["answered"].sum()),
        "in_flight": int((~uniq["answered"] & uniq["in_flight"]).sum()),
        "requests_to_send": n_send,
        "urgent_requests": urgent,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_request": per_request,
        "output_tokens_source": source,
        "expected_output_tokens_per_request": expected,
        "observed_output_tokens_per_request": observed,
        "estimate_usd": estimate,
        "budget_usd": budget,
        "over_budget": bool(budget is not None and estimate is not None and estimate > budget),
        "by_backend": by_backend,
        "skipped": skipped,
        "assumptions": assumptions,
        "prompt_cache": cache,
    }


def stable_prefix_tokens(job: JobSpec) -> int:
    """Tokens of what every request of `job` repeats before its own message (the system prompt
    and the few-shot turns), counted as `estimate_input_tokens` counts them."""
    return sum(count_tokens(m["content"]) + 4 for m in fixed_messages(job))


def _prompt_cache_quote(
    job: JobSpec, entry: BackendEntry, price: Price | None, n_send: int, urgent_share: float
) -> dict[str, Any] | None:
    """The `prompt_cache` field (see the module docstring); None when `entry` has no prompt
    cache that prices tokens."""
    model = job.model.name
    cache = prompt_cache.for_backend(entry, model)
    if cache is None:
        return None
    prefix = stable_prefix_tokens(job)
    cached = cache.cached_tokens(prefix)
    saved: float | None = None
    if price is not None:
        # urgent requests go at the realtime price, the rest at the batch price
        rate = price.batch_discount * (1 - urgent_share) + urgent_share
        reads = cached * max(0, n_send - 1) * (price.input - price.cached_input)
        write = cached * cache.write_premium * price.input if n_send else 0.0
        saved = (reads - write) / 1e6 * rate
    return {
        "prefix_tokens": prefix,
        "provider": cache.provider,
        "model": model,
        "min_tokens": cache.min_tokens,
        "cached": cached > 0,
        "cached_tokens_per_request": cached,
        "saved_usd": saved,
    }


def _route_quote(job: JobSpec, by_backend: dict[str, Any]) -> dict[str, Any]:
    """The route priced: each step's engine for everything left to send (batch price; None
    where that engine has no price), the best case (the first engine answers all) and the
    worst (the dearest engine of the route answers all; `paid_twice` would come on top)."""
    assert job.route is not None
    steps = []
    for engine in job.route.engines:
        cost = by_backend.get(engine)
        usd = cost["batch_usd"] if isinstance(cost, dict) else cost
        steps.append({"engine": engine, "model": job.route_models[engine], "usd": usd})
    priced = [s["usd"] for s in steps if s["usd"] is not None]
    return {
        "steps": steps,
        "best_usd": steps[0]["usd"],
        "worst_usd": max(priced) if priced else None,
        "unpriced": [s["engine"] for s in steps if s["usd"] is None],
    }
