"""Feed 4 emulated vLLM engines through lowtide's pool client; throughput against capacity.

Each scenario starts 4 fresh emulated engines (`lowtide.emulator.vllm_pool.start_engines`, one
uvicorn server per engine on its own thread, in this process) and runs `run_pool` over a
long-tailed workload until every request is answered:

- a shared system prompt; customers with an account-notes context of log-normal length
  (median 120 words) shared by all their messages (how many: Pareto, 1 to 40); each message
  of log-normal length (median 50 words, tail to 2,500); the dataset order shuffled;
- a JSON-schema extraction answer (topic, urgency, a summary, four keywords; ~80 tokens).

Achieved output tokens/s is measured over the whole run (first send to last answer, ramp-up and
drain included) and compared with the pool's computed ceiling: the sum over engines of
`capacity_tokens_per_s(config, workload)` for the requests each engine actually served (mean
prompt and output tokens and the prefix-cache share, read from the engine's own counters).
The emulator's billing ledger checks that every request ran exactly once.

    make bench-pool                                # 20,000 requests, about 6 minutes
    .venv/bin/python bench/bench_pool.py --quick   # 4,000 requests, about 1.5 minutes

`make bench-pool` runs `bench_pool_sweep.py` first (the feeder sweep: one pool client over 4,
16 and 64 engines in their own processes; a few minutes more); this script's line stays last.

The headline row (adaptive, bucketing on, prefix grouping on) runs the full `--requests`;
the comparison rows run `--compare-requests` (default a quarter of it, at least 2,000), and
the slow fixed caps 1 and 8 run fewer (their throughput is set by the cap, not by the tail).
The last line is machine-readable:
`pool: requests=N engines=4 capacity_fraction=<headline> (adaptive, bucketing on)`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import polars as pl

from lowtide.backends.vllm_pool import PoolConfig, PoolStats, run_pool
from lowtide.emulator.engine import EngineConfig, EngineStats, Workload, capacity_tokens_per_s
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.vllm_pool import start_engines
from lowtide.tokens import count_tokens

ENGINES = 4
MODEL = "emulated-model"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "enum": ["billing", "delivery", "account", "fraud", "other"]},
        "urgent": {"type": "boolean"},
        "summary": {"type": "string", "minLength": 120, "maxLength": 240},
        "keywords": {
            "type": "array",
            "items": {"type": "string", "maxLength": 40},
            "minItems": 4,
            "maxItems": 4,
        },
    },
    "required": ["topic", "urgent", "summary", "keywords"],
    "additionalProperties": False,
}
SYSTEM = (
    "You read one customer message for a retail bank, together with the account notes kept "
    "for that customer, and extract a structured record: the topic, whether it is urgent, a "
    "short summary in plain words and four keywords. Answer with the JSON object only. "
) * 2
WORDS = [
    "card",
    "payment",
    "refund",
    "delivery",
    "address",
    "account",
    "password",
    "fraud",
    "charge",
    "statement",
    "transfer",
    "branch",
    "loan",
    "savings",
    "interest",
    "fee",
    "limit",
    "online",
    "app",
    "login",
    "blocked",
    "stolen",
    "late",
    "waiting",
    "customer",
    "service",
    "phone",
    "email",
    "urgent",
    "please",
    "help",
    "yesterday",
    "today",
    "week",
    "month",
    "money",
    "euro",
    "mortgage",
    "overdraft",
    "salary",
    "invoice",
    "receipt",
    "merchant",
    "dispute",
    "pending",
    "cancelled",
    "chargeback",
]


def _words(rng: random.Random, median: float, sigma: float, low: int, high: int) -> str:
    n = min(high, max(low, int(rng.lognormvariate(math.log(median), sigma))))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_workload(n: int, seed: int = 0) -> pl.DataFrame:
    """`n` stored batch lines (custom_id, line) as lowtide's assembler writes them."""
    rng = random.Random(seed)
    users: list[str] = []
    customer = 0
    while len(users) < n:
        customer += 1
        notes = _words(rng, 120, 0.8, 20, 1500)
        for k in range(min(40, int(rng.paretovariate(1.2)))):
            text = _words(rng, 50, 1.0, 5, 2500)
            users.append(
                f"Account notes for customer {customer}:\n{notes}\n\n"
                f"New message ({customer}-{k}):\n{text}"
            )
    users = users[:n]
    rng.shuffle(users)
    ids = [f"bench-{i:06d}" for i in range(n)]
    lines = [
        orjson.dumps(
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": user},
                    ],
                    "temperature": 0.0,
                    "max_tokens": 400,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "ticket", "strict": True, "schema": SCHEMA},
                    },
                },
            }
        ).decode()
        for cid, user in zip(ids, users, strict=True)
    ]
    return pl.DataFrame({"custom_id": ids, "line": lines})


@dataclass
class Scenario:
    name: str
    requests: int
    adaptive: bool
    cap: int  # fixed cap, or the initial one when adaptive
    bucketing: bool
    grouping: bool


@dataclass
class Result:
    scenario: Scenario
    stats: PoolStats
    capacity: float
    prefix_share: float
    mean_prompt: float
    mean_output: float
    executions: int
    once: bool

    @property
    def fraction(self) -> float:
        return self.stats.output_tokens_per_s / self.capacity if self.capacity else 0.0


def _engine_workload(stats: EngineStats) -> tuple[int, Workload]:
    finished = stats.request_success.get("stop", 0) + stats.request_success.get("length", 0)
    if not finished:
        return 0, Workload(0, 1)
    share = (
        stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0
    )
    return finished, Workload(
        prompt_tokens=stats.prompt_tokens_total / finished,
        output_tokens=stats.generation_tokens_total / finished,
        prefix_share=share,
    )


def run_scenario(s: Scenario, engine: EngineConfig, seed: int) -> Result:
    requests = build_workload(s.requests, seed)
    ledger = BillingLedger()
    config = PoolConfig(
        urls=("http://placeholder/v1",),
        adaptive=s.adaptive,
        initial_inflight=s.cap,
        max_inflight=256 if s.adaptive else s.cap,
        bucketing=s.bucketing,
        prefix_grouping=s.grouping,
        checkpoint_every=500,
    )
    with start_engines(ENGINES, engine, ledger=ledger) as pool:
        stats = run_pool(requests, config.with_(urls=tuple(pool.urls)), lambda frame: None)
        engine_stats = [e.stats() for e in pool.engines]
    capacity = 0.0
    hits = queries = prompt = served = 0
    for es in engine_stats:
        finished, workload = _engine_workload(es)
        if finished:
            capacity += capacity_tokens_per_s(engine, workload)
        hits += es.prefix_cache_hits
        queries += es.prefix_cache_queries
        prompt += es.prompt_tokens_total
        served += finished
    counts = ledger.count_by_custom_id("vllm")
    once = len(counts) == s.requests and set(counts.values()) == {1}
    return Result(
        scenario=s,
        stats=stats,
        capacity=capacity,
        prefix_share=hits / queries if queries else 0.0,
        mean_prompt=prompt / served if served else 0.0,
        mean_output=stats.output_tokens / max(stats.answered, 1),
        executions=sum(counts.values()),
        once=once,
    )


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    n, m = args.requests, args.compare_requests
    return [
        Scenario("fixed cap 1", max(40, n // 200), False, 1, True, True),
        Scenario("fixed cap 8", max(200, n // 20), False, 8, True, True),
        Scenario("fixed cap 64", m, False, 64, True, True),
        Scenario("adaptive", m, True, 8, False, False),
        Scenario("adaptive", m, True, 8, True, False),
        Scenario("adaptive", m, True, 8, False, True),
        Scenario("adaptive", m, True, 8, True, True),
        Scenario("adaptive (headline)", n, True, 8, True, True),
    ]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def report(results: list[Result], engine: EngineConfig, args: argparse.Namespace) -> None:
    print(
        "| feeder | requests | bucketing | prefix grouping | wall s | output tok/s "
        "| ceiling tok/s | fraction of capacity | prefix-cache share | mean in-flight "
        "| errors | ran exactly once |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        s, st = r.scenario, r.stats
        print(
            f"| {s.name} | {s.requests} | {_on(s.bucketing)} | {_on(s.grouping)} "
            f"| {st.wall_s:.1f} | {st.output_tokens_per_s:.0f} | {r.capacity:.0f} "
            f"| {r.fraction:.3f} | {r.prefix_share:.2f} | {st.mean_inflight:.0f} "
            f"| {st.errors} | {'yes' if r.once else f'no ({r.executions} runs)'} |"
        )
    head = results[-1]
    print()
    print(
        f"Workload: mean prompt {head.mean_prompt:.0f} tokens, mean output "
        f"{head.mean_output:.0f} tokens (headline run). Engines: {ENGINES} x "
        f"max_num_seqs={engine.max_num_seqs}, max_num_batched_tokens="
        f"{engine.max_num_batched_tokens}, kv_cache_tokens={engine.kv_cache_tokens}, prefill "
        f"{engine.prefill_tokens_per_s:.0f} tok/s, step {engine.decode_step_s_base} s + "
        f"{engine.decode_step_s_per_seq} s/seq, time_scale={engine.time_scale:g}. Adaptive "
        "rows start at 8 in flight per engine (bounds 1..256); fixed rows hold their cap."
    )
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}, "
        f"{datetime.now(UTC).strftime('%Y-%m-%d')}; engines and client in one process; "
        f"load average at the end {load} (other work on the host lowers every row)."
    )
    print(
        f"pool: requests={head.scenario.requests} engines={ENGINES} "
        f"capacity_fraction={head.fraction:.3f} (adaptive, bucketing on)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000, help="requests in the headline run")
    p.add_argument(
        "--compare-requests",
        type=int,
        default=None,
        help="requests per comparison row (default: a quarter of --requests, at least 2,000)",
    )
    p.add_argument("--quick", action="store_true", help="4,000 requests (about 1.5 minutes)")
    p.add_argument("--time-scale", type=float, default=2.0, help="engine time compression")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only-headline", action="store_true", help="run the headline row only (no comparisons)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.requests = 4_000
    if args.compare_requests is None:
        args.compare_requests = min(args.requests, max(2_000, args.requests // 4))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # The emulated engines tokenize in this process; load the vocabulary before any clock runs
    # (a real server is warm before it takes traffic).
    count_tokens("warm up")
    engine = EngineConfig(max_num_seqs=args.max_num_seqs, time_scale=args.time_scale)
    plan = scenarios(args)
    if args.only_headline:
        plan = plan[-1:]
    results = []
    for s in plan:
        started = time.monotonic()
        r = run_scenario(s, engine, args.seed)
        results.append(r)
        print(
            f"  {s.name}, {s.requests} requests, bucketing {_on(s.bucketing)}, grouping "
            f"{_on(s.grouping)}: {r.fraction:.3f} of capacity in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    report(results, engine, args)


if __name__ == "__main__":
    main()
