"""Backend 'vllm': batch semantics over a pool of OpenAI-compatible servers (`vllm serve`, SGLang).

No server in the pool knows about batches: every stored request line's `body` is sent as one
`POST /v1/chat/completions` to one endpoint, and the pool gives the whole set batch semantics —
every request ends answered or as a `provider_error` row, exactly once, and results reach the
store in small groups as they arrive, so a killed run resumes with only the unanswered requests.

How requests are fed (`run_pool`):

- **Bounded, stocked queues.** Each endpoint has an in-flight cap. With `adaptive`, the cap
  follows the server's `/metrics` (polled every `metrics_interval_s`; see `control.on_metrics`
  and `control.next_cap`): the aim is a server running all it can with a small queue waiting
  (`headroom(running)`, about one step's worth of finishing sequences, so a freed slot is
  refilled from the server's own queue without a client round trip). The cap grows (doubling
  until the first shrink, polling four times as often meanwhile, then x1.125) while no more
  than that waits (`vllm:num_requests_waiting`) and the KV cache has room
  (`vllm:kv_cache_usage_perc` < `kv_grow_below`); it shrinks by the excess when more wait at
  two polls in a row. It never leaves [`min_inflight`, `max_inflight`]. A 503 (vLLM's answer
  when `--max-num-queued-reqs` is full) halves it. Without `adaptive` it stays at
  `initial_inflight`. Growth does not wait for the queue to be empty: requests that arrived
  since the server's current step began are always counted as waiting, so "grow only at zero"
  would hold the cap below the server's slots.
- **Bucketing**: requests go out longest first (by `est_input_tokens`, else line bytes / 4),
  so the long ones do not straggle at the end of the run.
- **Prefix grouping**: requests whose prompts start the same go to the same endpoint, so its
  prefix cache serves the shared part. The group key is the hash of the model, every message
  before the last user message (system prompt, few-shot turns: shared by all of a job's
  requests, so on its own it would put the whole job in one group) and the first
  `prefix_chars` characters of the last user message — equal there means a shared prefix of
  roughly `prefix_chars / 4` tokens beyond the fixed part (a template with a per-document or
  per-customer context before the row's own text). Groups are packed onto endpoints by
  estimated work (largest first, onto the least loaded); a group bigger than a quarter of an
  endpoint's share is cut into pieces, because every engine caches a prefix that common after
  its first request anyway. An endpoint that runs out of its own work takes requests from the
  back of the fullest other endpoint's queue, so no engine idles at the end.
- **Failover**: a refused or timed-out connection marks an endpoint down at once; a dropped
  connection, a read timeout or a 5xx triggers a `/health` probe that marks it down when it
  does not answer 200. A down endpoint's queued requests go to the others; its in-flight
  requests go back to the queue when they fail, or after `connect_timeout_s` if they hang. It
  is probed every `health_interval_s` and rejoins (cap back to `initial_inflight`) when healthy.
  A request is re-sent only when its response never arrived; one that arrived is never re-sent.
  When every endpoint stays down for `give_up_after_s`, the run stops with
  `TransientBackendError` after checkpointing what it has.
- **Discovery** (`[pool] discover = "dns:NAME:PORT"`, see `discovery`): the endpoints are the
  addresses NAME resolves to (a Kubernetes headless Service), looked up again every
  `discover_interval_s`. A new address joins (a /health probe, then the start cap); one that
  is gone is drained: sent nothing new, its queue moved to the others, its in-flight requests
  left to finish — or, when its engine is gone too, failed over as above. A failed lookup
  keeps the endpoints the pool has.
- **Errors**: 4xx answers become `provider_error` rows at once (401/403 stop the run: the key
  is wrong for every request). The transient ones (`wire.is_transient_status`: 408, 409, 429,
  5xx) and transport errors are retried — on whichever endpoint is free, after an exponential
  backoff with jitter that honours `Retry-After` — up to `max_attempts` sends, then become
  `provider_error` rows. A connection that was refused is not counted as an attempt (the
  request never reached a server).

HTTP goes through httpx2, the HTTP stack the openai SDK ships (no further dependency), used
directly: the stored body is sent as it is, and the SDK's typed response objects would cost CPU
per request that a client feeding several engines at hundreds of requests per second needs
for itself. Chat requests are spread over small connection pools (see `endpoint.py`).

Retries are owned here, not by tenacity as elsewhere in lowtide: a retried request re-enters
the pool's queue so that it can move to another endpoint, which a wrap-the-call retry cannot
express; the HTTP client itself never retries.

Checkpointing: `checkpoint(frame)` receives RESULT_SCHEMA frames of `checkpoint_every` rows (the
last one smaller), one call at a time and in order, from a worker thread (the event loop keeps
feeding the engines while the store writes). If it raises, the run stops and re-raises.

Layout: `config` (PoolConfig, the environment names), `control` (the control law: ordering,
grouping, the cap controller, /metrics, status verdicts, backoff; pure and table-tested),
`queues` (which request is where), `endpoint` (one server's clients and state), `runner` (the
event loop), `discovery` (endpoints that follow a DNS name), `stats` (PoolStats), `run_batch`
(`vllm run-batch` shards). Rules shared with the
other HTTP backends (transient statuses, Retry-After, completion → row) are in
`lowtide.backends.wire`.
"""

from __future__ import annotations

from lowtide.backends.vllm_pool.config import (
    CAPABILITIES,
    CHAT_PATH,
    CUSTOM_ID_HEADER,
    ENV_API_KEY,
    ENV_URLS,
    PoolConfig,
    PoolConfigError,
    normalize_url,
)
from lowtide.backends.vllm_pool.control import (
    CapControl,
    EngineLoad,
    Verdict,
    assign_groups,
    backoff_delay,
    headroom,
    next_cap,
    on_metrics,
    on_overload,
    parse_metrics,
    poll_interval,
    prefix_key,
    request_weights,
    send_order,
    verdict,
)
from lowtide.backends.vllm_pool.run_batch import (
    run_batch_results,
    write_run_batch_shards,
)
from lowtide.backends.vllm_pool.runner import (
    Checkpoint,
    run_pool,
    run_pool_async,
)
from lowtide.backends.vllm_pool.stats import (
    EndpointStats,
    PoolStats,
)

__all__ = [
    "CAPABILITIES",
    "CHAT_PATH",
    "CUSTOM_ID_HEADER",
    "ENV_API_KEY",
    "ENV_URLS",
    "CapControl",
    "Checkpoint",
    "EndpointStats",
    "EngineLoad",
    "PoolConfig",
    "PoolConfigError",
    "PoolStats",
    "Verdict",
    "assign_groups",
    "backoff_delay",
    "headroom",
    "next_cap",
    "normalize_url",
    "on_metrics",
    "on_overload",
    "parse_metrics",
    "poll_interval",
    "prefix_key",
    "request_weights",
    "run_batch_results",
    "run_pool",
    "run_pool_async",
    "send_order",
    "verdict",
    "write_run_batch_shards",
]
