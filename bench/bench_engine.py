"""Saturate one emulated vLLM engine: throughput against client concurrency.

Starts `python -m lowtide.emulator.vllm` in a subprocess (its own core and event loop), then
for each concurrency level runs that many closed-loop clients (the official openai SDK) over a
fixed workload — a shared system prompt and long-tailed user texts, JSON-schema output — and
measures requests/s and output tokens/s over a window after a warm-up. Each level drains
before the next starts. The ceiling comes from `lowtide.emulator.engine.capacity` for the
measured workload (mean prompt and output tokens and the prefix-cache share, all from the
responses' `usage.prompt_tokens_details.cached_tokens`), so each level's throughput is also shown as a
fraction of it.

    .venv/bin/python bench/bench_engine.py                 # default sweep, under 2 minutes
    .venv/bin/python bench/bench_engine.py --seconds 3 --concurrency 1,16,64,256   # quicker

The last line is machine-readable:
`engine: capacity_tokens_per_s=<ceiling> peak_fraction=<best level / ceiling>`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from lowtide.emulator.engine import EngineConfig, Workload, capacity, capacity_tokens_per_s

ROOT = Path(__file__).resolve().parents[1]

MODEL = "emulated-model"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "enum": ["billing", "delivery", "account", "fraud", "other"]},
        "summary": {"type": "string", "maxLength": 80},
        "urgent": {"type": "boolean"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["topic", "summary", "urgent", "confidence"],
    "additionalProperties": False,
}
SYSTEM = (
    "You read one customer message for a retail bank and classify it. Return a JSON object "
    "with the topic, a short summary in plain words, whether it is urgent, and your "
    "confidence. Do not add any other text. "
) * 3
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
]


def build_workload(n: int, seed: int) -> list[list[dict[str, str]]]:
    """`n` chat requests: the shared system prompt, then a user text of log-normal length
    (median ~120 words, long tail up to 3,000)."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        words = min(3000, max(8, int(rng.lognormvariate(math.log(120), 0.9))))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        requests.append(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Message {i}: {text}"},
            ]
        )
    return requests


@dataclass
class Level:
    concurrency: int
    requests: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    window_s: float = 0.0
    mean_running: float = 0.0
    mean_waiting: float = 0.0
    cached_tokens: int = 0
    sim_s: float = 0.0
    sim_tokens: int = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "lowtide.emulator.vllm",
        "--port",
        str(port),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--time-scale",
        str(args.time_scale),
        "--enable-prompt-tokens-details",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"emulated vLLM server exited with {proc.returncode}: {cmd}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("emulated vLLM server did not become healthy within 30 s")


async def stats(http: httpx.AsyncClient, base: str) -> dict[str, Any]:
    return (await http.get(f"{base}/_emulator/stats")).json()


async def run_level(
    client: Any,
    http: httpx.AsyncClient,
    base: str,
    workload: list[list[dict[str, str]]],
    cursor: list[int],
    concurrency: int,
    warmup: float,
    seconds: float,
) -> Level:
    level = Level(concurrency)
    start = time.monotonic()
    window_start, window_end = start + warmup, start + warmup + seconds
    first: dict[str, Any] = {}

    async def snapshot_at_window_start() -> None:
        await asyncio.sleep(warmup)
        first.update(await stats(http, base))

    async def worker() -> None:
        while time.monotonic() < window_end:
            messages = workload[cursor[0] % len(workload)]
            cursor[0] += 1
            sent = time.monotonic()
            try:
                response = await client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=256,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "ticket", "schema": SCHEMA},
                    },
                )
            except openai.APIError as exc:  # counted in the table and shown here
                level.errors += 1
                print(f"  request failed at concurrency {concurrency}: {exc!r}", file=sys.stderr)
                continue
            done = time.monotonic()
            if window_start <= done < window_end:
                level.requests += 1
                level.output_tokens += response.usage.completion_tokens
                level.prompt_tokens += response.usage.prompt_tokens
                level.cached_tokens += response.usage.prompt_tokens_details.cached_tokens
                level.latencies.append(done - sent)

    snap = asyncio.create_task(snapshot_at_window_start())
    await asyncio.sleep(0)
    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(max(window_end - time.monotonic(), 0))
    last = await stats(http, base)
    await snap
    await asyncio.gather(*workers)  # drain: workers finish their last request and stop
    level.window_s = seconds
    sim = last["sim_seconds"] - first["sim_seconds"]
    level.sim_s = sim
    level.sim_tokens = last["generation_tokens_total"] - first["generation_tokens_total"]
    if sim > 0:
        level.mean_running = (last["running_seq_seconds"] - first["running_seq_seconds"]) / sim
        level.mean_waiting = (last["waiting_seq_seconds"] - first["waiting_seq_seconds"]) / sim
    return level


async def sweep(args: argparse.Namespace, base: str) -> list[Level]:
    import httpx2  # the openai SDK's HTTP stack

    workload = build_workload(args.requests, args.seed)
    limits = httpx2.Limits(max_connections=2048, max_keepalive_connections=2048)
    client = openai.AsyncOpenAI(
        base_url=f"{base}/v1",
        api_key="x",
        max_retries=0,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    )
    cursor = [0]
    levels = []
    async with httpx.AsyncClient(timeout=30) as http:
        for concurrency in args.concurrency:
            level = await run_level(
                client, http, base, workload, cursor, concurrency, args.warmup, args.seconds
            )
            levels.append(level)
            print(
                f"  concurrency {concurrency:>4}: {level.requests / level.window_s:7.1f} req/s, "
                f"{level.output_tokens / level.window_s:8.0f} output tok/s, "
                f"engine clock {level.sim_s / level.window_s:.2f} sim s per s, "
                f"{level.sim_tokens / max(level.sim_s, 1e-9):.0f} tok per sim s",
                file=sys.stderr,
            )
    await client.close()
    print(f"  workload: {cursor[0]} requests sent from a set of {len(workload)}", file=sys.stderr)
    return levels


def workload_of(levels: list[Level]) -> Workload:
    """Mean request shape of the requests measured in `levels`."""
    total = sum(lv.requests for lv in levels)
    prompt = sum(lv.prompt_tokens for lv in levels)
    return Workload(
        prompt_tokens=prompt / total,
        output_tokens=sum(lv.output_tokens for lv in levels) / total,
        prefix_share=sum(lv.cached_tokens for lv in levels) / prompt,
    )


def report(args: argparse.Namespace, levels: list[Level]) -> None:
    config = EngineConfig(max_num_seqs=args.max_num_seqs, time_scale=args.time_scale)
    workload = workload_of(levels)
    ceiling = capacity(config, workload)
    print(
        "| concurrency | requests/s | output tok/s | ceiling tok/s | fraction of capacity "
        "| mean running | mean waiting | p50 latency s | errors |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    peak = 0.0
    for lv in levels:
        tokens_per_s = lv.output_tokens / lv.window_s
        # Long-tailed prompts make each window's mix differ a little from the overall mean,
        # so each level is held against the ceiling for the requests it actually measured.
        level_ceiling = capacity_tokens_per_s(config, workload_of([lv])) if lv.requests else 0
        fraction = tokens_per_s / level_ceiling if level_ceiling else 0.0
        peak = max(peak, fraction)
        p50 = statistics.median(lv.latencies) if lv.latencies else float("nan")
        print(
            f"| {lv.concurrency} | {lv.requests / lv.window_s:.1f} | {tokens_per_s:.0f} "
            f"| {level_ceiling:.0f} | {fraction:.3f} | {lv.mean_running:.1f} "
            f"| {lv.mean_waiting:.1f} | {p50:.3f} | {lv.errors} |"
        )
    print()
    print(
        f"Capacity ceiling: {ceiling.output_tokens_per_s:.0f} output tok/s "
        f"({ceiling.requests_per_s:.1f} req/s), limited by {ceiling.limited_by} "
        f"(batch {ceiling.batch:.0f}); workload: mean prompt {workload.prompt_tokens:.0f} tokens, "
        f"mean output {workload.output_tokens:.1f} tokens, prefix-cache share "
        f"{workload.prefix_share:.2f}."
    )
    print(
        f"Engine: max_num_seqs={config.max_num_seqs}, max_num_batched_tokens="
        f"{config.max_num_batched_tokens}, kv_cache_tokens={config.kv_cache_tokens}, "
        f"prefill {config.prefill_tokens_per_s:.0f} tok/s, step {config.decode_step_s_base} s "
        f"+ {config.decode_step_s_per_seq} s/seq, time_scale={config.time_scale:g} "
        f"(rates above are per wall-clock second)."
    )
    print(
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}; {args.seconds:g} s window after "
        f"{args.warmup:g} s warm-up per level; server in its own process, clients in this one."
    )
    print(
        f"engine: capacity_tokens_per_s={ceiling.output_tokens_per_s:.0f} peak_fraction={peak:.3f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        help="comma-separated client concurrency levels",
    )
    p.add_argument("--requests", type=int, default=4000, help="distinct requests in the workload")
    p.add_argument("--seconds", type=float, default=7.0, help="measured window per level")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per level")
    p.add_argument("--time-scale", type=float, default=2.0, help="engine time compression")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    port = free_port()
    server = start_server(args, port)
    try:
        levels = asyncio.run(sweep(args, f"http://127.0.0.1:{port}"))
    finally:
        server.terminate()
        server.wait(timeout=10)
    report(args, levels)


if __name__ == "__main__":
    main()
