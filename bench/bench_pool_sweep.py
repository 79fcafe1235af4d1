"""How far one feeder goes: lowtide's vLLM pool client over 4, 16 and 64 emulated engines.

For each engine count the emulated engines run in their own process(es) (`--engine-procs`,
`lowtide.emulator.vllm_pool.start_engines`), and the requests are fed by `--feeders` separate
processes, each running lowtide's own `run_pool` over its share of the requests and its group
of engines (one feeder: every request, every engine). Nothing else runs in a feeder while it
feeds, so its process CPU time (`os.times`, all threads) is what the pool client costs.

The workload is `bench_pool.build_workload` (long-tailed customer messages with shared
per-customer notes, a JSON-schema answer of ~80 tokens). With several feeders it is split by
the pool's own prefix groups (`prefix_key` + `assign_groups`), so requests that share a prefix
still meet on one engine.

Every row gets the same total engine capacity (`--rate`, requests/s): the time scale of each
engine is set so that N engines together serve about that many requests per second, and every
engine gets `--requests-per-engine` requests. So the rows differ only in how many engines the
same stream of requests is spread over, and the engines fit in what this machine can emulate.
`--time-scale` fixes the engine speed instead (then capacity grows with the engine count).

Capacity is the emulator's own engine model (`lowtide.emulator.engine.capacity`) applied to the
requests each engine actually served (mean prompt and output tokens, prefix-cache share, from
the engine's counters): the rate at which the engines would have served exactly this work had
each been kept full from the first send to the last answer. The fraction is achieved / that.
"steady" is the same ratio between the 10 % and 90 % finished marks (each request's finish
time and tokens from the engines' billing ledger; capacity for that window's own mix), leaving
out ramp-up and the drain at the end, which a million-row job does not notice. The same
ledger checks that every request ran exactly once.

    .venv/bin/python bench/bench_pool_sweep.py                 # 4/16/64 engines, one feeder
    .venv/bin/python bench/bench_pool_sweep.py --feeders 1,2   # and again with two feeders
    .venv/bin/python bench/bench_pool_sweep.py --quick         # smaller, about a minute

The last line is for scripts:
`pool-sweep: engines=64 feeders=K fraction=<whole run> steady=<steady> cpu_ms_per_request=<ms>`
(the largest engine count, its best feeder count).
"""

from __future__ import annotations

import argparse
import os
import platform
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import polars as pl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = Path(__file__).resolve()

# The pool client as a job runs it by default (PoolConfig / [pool] defaults), spelled out here
# so the report line names them.
FEED_CONFIG: dict[str, Any] = {
    "adaptive": True,
    "initial_inflight": 8,
    "max_inflight": 256,
    "bucketing": True,
    "prefix_grouping": True,
    "checkpoint_every": 200,
}


# -- child processes: the engines, the feeders --------------------------------------------------


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def serve_engines(args: argparse.Namespace) -> None:
    """Child: run `--count` emulated engines until told to quit; answer 'cpu' and 'stats' on
    stdin with one JSON line on stdout."""
    from lowtide.emulator.engine import EngineConfig
    from lowtide.emulator.ledger import BillingLedger
    from lowtide.emulator.vllm_pool import start_engines
    from lowtide.tokens import count_tokens

    count_tokens("warm up")  # the engines tokenize; load the vocabulary before any clock runs
    config = EngineConfig(max_num_seqs=args.max_num_seqs, time_scale=args.time_scale)
    ledger = BillingLedger()
    with start_engines(args.count, config, ledger=ledger) as pool:
        _say({"urls": pool.urls})
        for line in sys.stdin:
            command = line.strip()
            if command == "cpu":
                _say({"cpu_s": _cpu_s()})
            elif command == "stats":
                runs = ledger.executions("vllm")
                counts = ledger.count_by_custom_id("vllm")
                engines = []
                for e in pool.engines:
                    s = e.stats()
                    engines.append(
                        {
                            "finished": sum(
                                s.request_success.get(k, 0) for k in ("stop", "length")
                            ),
                            "prompt_tokens": s.prompt_tokens_total,
                            "output_tokens": s.generation_tokens_total,
                            "prefix_hits": s.prefix_cache_hits,
                            "prefix_queries": s.prefix_cache_queries,
                            "sim_s": s.sim_seconds,
                            "running_seq_s": s.running_seq_seconds,
                            "waiting_seq_s": s.waiting_seq_seconds,
                            "preemptions": s.preemptions,
                        }
                    )
                _say(
                    {
                        "cpu_s": _cpu_s(),
                        "engines": engines,
                        "runs": sum(counts.values()),
                        "distinct": len(counts),
                        "most_runs": max(counts.values(), default=0),
                        # when each request finished, with its tokens: the steady window
                        "done": [
                            (
                                r["at"],
                                r["input_tokens"],
                                r["cached_input_tokens"],
                                r["output_tokens"],
                            )
                            for r in runs
                        ],
                    }
                )
            elif command == "quit":
                break


def feed(args: argparse.Namespace) -> None:
    """Child: load a share of the requests, say ready, wait for 'go', run lowtide's `run_pool`
    over it against `--urls`, report its numbers and this process's CPU time as one JSON line."""
    from lowtide.backends.vllm_pool import PoolConfig, run_pool

    requests = pl.read_parquet(args.requests_file)
    config = PoolConfig(urls=tuple(args.urls.split(",")), **FEED_CONFIG)
    written = [0]

    def checkpoint(frame: pl.DataFrame) -> None:  # the store's place; here only a count
        written[0] += frame.height

    _say({"ready": True})
    sys.stdin.readline()
    cpu0, t0 = _cpu_s(), time.monotonic()
    stats = run_pool(requests, config, checkpoint)
    t1, cpu1 = time.monotonic(), _cpu_s()
    _say(
        {
            "requests": stats.requests,
            "answered": stats.answered,
            "errors": stats.errors,
            "retries": stats.retries,
            "failovers": stats.failovers,
            "resent": len(stats.resent),
            "started": t0,
            "ended": t1,
            "cpu_s": cpu1 - cpu0,
            "mean_inflight": stats.mean_inflight,
            "checkpointed": written[0],
        }
    )


# -- the sweep ----------------------------------------------------------------------------------


class Child:
    """A child process of this script speaking JSON lines over stdin/stdout."""

    def __init__(self, role: str, *argv: str) -> None:
        self.name = " ".join((role, *argv))
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--role", role, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def send(self, line: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(line + "\n")
        stdin.flush()

    def read(self, timeout_s: float = 1800.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.proc.kill()
            raise RuntimeError(f"bench child '{self.name}' sent nothing for {timeout_s:g} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"bench child '{self.name}' exited ({code}) without a reply")
        return orjson.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.send(command)
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=15)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@dataclass
class Row:
    engines: int
    feeders: int
    engine_procs: int
    requests: int
    time_scale: float
    answered: int = 0
    errors: int = 0
    wall_s: float = 0.0
    capacity_rps: float = 0.0
    steady_rps: float = 0.0
    steady_capacity_rps: float = 0.0
    feeder_cpu_s: float = 0.0
    feeder_busiest: float = 0.0  # the busiest feeder's CPU seconds per wall second
    engine_cpu_s: float = 0.0
    engine_busiest: float = 0.0  # the busiest engine process's CPU seconds per wall second
    host_busy: float = 0.0  # cores busy on the whole machine (all processes), mean over the run
    mean_running: float = 0.0  # per engine, while it was busy
    mean_waiting: float = 0.0
    engine_clock: float = 0.0  # simulated seconds the engines ran / (N * wall * time scale)
    max_num_seqs: int = 0
    once: bool = False
    runs: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.answered / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def fraction(self) -> float:
        return self.rps / self.capacity_rps if self.capacity_rps else 0.0

    @property
    def steady(self) -> float:
        return self.steady_rps / self.steady_capacity_rps if self.steady_capacity_rps else 0.0

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.feeder_cpu_s / self.answered if self.answered else 0.0

    @property
    def others_busy(self) -> float:
        """Cores other processes on the machine kept busy during the run (not this bench)."""
        ours = (self.feeder_cpu_s + self.engine_cpu_s) / self.wall_s if self.wall_s else 0.0
        return max(self.host_busy - ours, 0.0)

    @property
    def limited_by(self) -> str:
        """Which side held the row below its capacity, from the utilisations (a heuristic)."""
        cores = os.cpu_count() or 1
        if self.feeder_busiest >= 0.85:
            return f"feeder CPU ({self.feeder_busiest:.2f} core)"
        if self.engine_busiest >= 0.85:
            return f"emulator CPU ({self.engine_busiest:.2f} core)"
        if self.mean_running < 0.9 * self.max_num_seqs and self.mean_waiting < 1:
            return "feeding (engine slots not kept full)"
        if self.engine_clock < 0.9 and self.host_busy >= 0.9 * cores:
            return (
                f"host CPU ({self.host_busy:.1f} of {cores} cores busy, "
                f"{self.others_busy:.1f} by other work; engine clocks behind)"
            )
        return "engines (fill at the start, drain at the end)"


def _host_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def _split(items: Sequence[Any], k: int) -> list[list[Any]]:
    """`items` in `k` contiguous runs of sizes differing by at most one."""
    q, r = divmod(len(items), k)
    out, start = [], 0
    for j in range(k):
        end = start + q + (1 if j < r else 0)
        out.append(list(items[start:end]))
        start = end
    return out


def split_requests(requests: pl.DataFrame, k: int) -> list[pl.DataFrame]:
    """The requests in `k` shares of about equal work, keeping each prefix group in one share
    (the pool's own grouping: `prefix_key`, `request_weights`, `assign_groups`)."""
    from lowtide.backends.vllm_pool import PoolConfig, assign_groups, prefix_key, request_weights

    if k == 1:
        return [requests]
    chars = PoolConfig(urls=("http://x/v1",)).prefix_chars
    keys = [prefix_key(orjson.loads(line)["body"], chars) for line in requests["line"]]
    shares = assign_groups(keys, request_weights(requests), k, bucketing=False)
    return [requests[sorted(share)] for share in shares]


def per_engine_rate(requests: pl.DataFrame, max_num_seqs: int, sample: int = 400) -> float:
    """Requests/s one engine at time_scale 1 serves for this workload, by the engine model, from
    the emulated model's answers to a sample (prefix share 0.4, a planning figure only: the
    table's capacity uses what the engines measured)."""
    from lowtide.emulator import model as emulated_model
    from lowtide.emulator.engine import EngineConfig, Workload, capacity

    prompt = output = 0
    lines = requests["line"].head(sample).to_list()
    for line in lines:
        body = orjson.loads(line)["body"]
        fmt = body["response_format"]["json_schema"]["schema"]
        a = emulated_model.answer(
            body["messages"], schema=fmt, max_tokens=body["max_tokens"], model=body["model"]
        )
        prompt += a.prompt_tokens
        output += a.completion_tokens
    workload = Workload(prompt / len(lines), output / len(lines), prefix_share=0.4)
    return capacity(EngineConfig(max_num_seqs=max_num_seqs), workload).requests_per_s


def _capacity(engines: list[dict[str, Any]], max_num_seqs: int, time_scale: float) -> float:
    """Requests/s the engines' model gives for the work each engine served, if all of them
    were busy the whole time: total requests over (sum of each engine's ideal busy time / N)."""
    from lowtide.emulator.engine import EngineConfig, Workload, capacity

    config = EngineConfig(max_num_seqs=max_num_seqs, time_scale=time_scale)
    total = busy = 0.0
    for e in engines:
        n = e["finished"]
        if not n:
            continue
        share = e["prefix_hits"] / e["prefix_queries"] if e["prefix_queries"] else 0.0
        w = Workload(e["prompt_tokens"] / n, e["output_tokens"] / n, share)
        total += n
        busy += n / capacity(config, w).requests_per_s
    return total / (busy / len(engines)) if busy else 0.0


def _steady(
    done: list[tuple[float, int, int, int]], engines: int, max_num_seqs: int, time_scale: float
) -> tuple[float, float]:
    """(answers per second, the engines' capacity for those answers) between the 10 % and the
    90 % finished marks, from the engines' own ledger (finish time and tokens per request).
    The capacity is taken for the window's own mix: longest-first sending puts the dearest
    requests at the start, so the whole run's mix would flatter the window."""
    from lowtide.emulator.engine import EngineConfig, Workload, capacity

    done = sorted(done)
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done))
    if hi - lo < 2 or done[hi][0] <= done[lo][0]:
        return 0.0, 0.0
    window = done[lo + 1 : hi + 1]
    n = len(window)
    prompt = sum(d[1] for d in window)
    cached = sum(d[2] for d in window)
    output = sum(d[3] for d in window)
    config = EngineConfig(max_num_seqs=max_num_seqs, time_scale=time_scale)
    mix = Workload(prompt / n, output / n, cached / prompt if prompt else 0.0)
    return n / (done[hi][0] - done[lo][0]), engines * capacity(config, mix).requests_per_s


def run_row(
    requests: pl.DataFrame,
    engines: int,
    feeders: int,
    engine_procs: int,
    time_scale: float,
    args: argparse.Namespace,
    tmp: Path,
) -> Row:
    row = Row(engines, feeders, engine_procs, requests.height, time_scale)
    hosts: list[Child] = []
    feeds: list[Child] = []
    try:
        for count in _split(range(engines), engine_procs):
            hosts.append(
                Child(
                    "engines",
                    f"--count={len(count)}",
                    f"--time-scale={time_scale!r}",
                    f"--max-num-seqs={args.max_num_seqs}",
                )
            )
        urls = [u for h in hosts for u in h.read()["urls"]]
        groups = _split(urls, feeders)
        shares = split_requests(requests, feeders)
        for j, (group, share) in enumerate(zip(groups, shares, strict=True)):
            path = tmp / f"share-{engines}-{feeders}-{j}.parquet"
            share.write_parquet(path)
            feeds.append(Child("feed", f"--requests-file={path}", f"--urls={','.join(group)}"))
        for f in feeds:
            f.read()  # ready
        cpu0 = [h.ask("cpu")["cpu_s"] for h in hosts]
        busy0, total0 = _host_ticks()
        for f in feeds:
            f.send("go")
        results = [f.read() for f in feeds]
        busy1, total1 = _host_ticks()
        stats = [h.ask("stats") for h in hosts]
    finally:
        for c in feeds + hosts:
            c.close()
    row.wall_s = max(r["ended"] for r in results) - min(r["started"] for r in results)
    row.answered = sum(r["answered"] for r in results)
    row.errors = sum(r["errors"] for r in results)
    row.feeder_cpu_s = sum(r["cpu_s"] for r in results)
    row.feeder_busiest = max(r["cpu_s"] / (r["ended"] - r["started"]) for r in results)
    engine_cpu = [s["cpu_s"] - c for s, c in zip(stats, cpu0, strict=True)]
    row.engine_cpu_s = sum(engine_cpu)
    row.engine_busiest = max(engine_cpu) / row.wall_s
    row.host_busy = (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)
    per_engine = [e for s in stats for e in s["engines"]]
    row.capacity_rps = _capacity(per_engine, args.max_num_seqs, time_scale)
    row.steady_rps, row.steady_capacity_rps = _steady(
        [(d[0], d[1], d[2], d[3]) for st in stats for d in st["done"]],
        engines,
        args.max_num_seqs,
        time_scale,
    )
    sim = sum(e["sim_s"] for e in per_engine)
    row.mean_running = sum(e["running_seq_s"] for e in per_engine) / sim if sim else 0.0
    row.mean_waiting = sum(e["waiting_seq_s"] for e in per_engine) / sim if sim else 0.0
    row.engine_clock = sim / (engines * row.wall_s * time_scale)
    row.max_num_seqs = args.max_num_seqs
    row.runs = sum(s["runs"] for s in stats)
    row.once = (
        sum(s["distinct"] for s in stats) == requests.height
        and row.runs == requests.height
        and max(s["most_runs"] for s in stats) == 1
    )
    for r in results:
        if r["retries"] or r["failovers"] or r["resent"]:
            row.notes.append(
                f"retries {r['retries']}, failovers {r['failovers']}, resent {r['resent']}"
            )
    return row


def report(rows: list[Row], args: argparse.Namespace, started: float) -> None:
    print(
        "| engines | feeder processes | requests | wall s | req/s achieved | capacity req/s "
        "| fraction | steady fraction | feeder CPU s | CPU ms per request | busiest feeder "
        "| emulator CPU s | running / waiting per engine | engine clock | host cores busy (others) "
        "| limited by | ran exactly once |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        once = "yes" if r.once else f"no ({r.runs} runs, {r.errors} errors)"
        print(
            f"| {r.engines} engines | {r.feeders} | {r.requests} | {r.wall_s:.1f} | {r.rps:.1f} "
            f"| {r.capacity_rps:.1f} | {r.fraction:.3f} | {r.steady:.3f} | {r.feeder_cpu_s:.1f} "
            f"| {r.cpu_ms_per_request:.2f} | {r.feeder_busiest:.2f} core "
            f"| {r.engine_cpu_s:.1f} ({r.engine_procs} proc) "
            f"| {r.mean_running:.1f} / {r.mean_waiting:.1f} | {r.engine_clock:.2f} "
            f"| {r.host_busy:.2f} ({r.others_busy:.2f}) "
            f"| {r.limited_by} | {once} |"
        )
    print()
    scales = {r.engines: r.time_scale for r in rows}
    speed = (
        f"time scale {args.time_scale:g} for every row"
        if args.time_scale
        else f"time scale set per row so the engines together serve about {args.rate:g} "
        f"req/s ({', '.join(f'{n}: {ts:.3g}' for n, ts in scales.items())})"
    )
    print(
        f"Engines: max_num_seqs={args.max_num_seqs} (other settings as EngineConfig's defaults), "
        f"{speed}; {args.requests_per_engine} requests per engine; feeders run run_pool with "
        f"{', '.join(f'{k}={v}' for k, v in FEED_CONFIG.items())} and a checkpoint that only "
        "counts rows (no store writes)."
    )
    cpu = _cpu_model()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}; engines and feeders in separate processes "
        f"on the same cores; load average at the end {load}; "
        f"{time.monotonic() - started:.0f} s in all."
    )
    top = max(r.engines for r in rows)
    best = max((r for r in rows if r.engines == top), key=lambda r: r.fraction)
    for r in rows:
        for note in r.notes:
            print(f"  {r.engines} engines / {r.feeders} feeders: {note}")
    print(
        f"pool-sweep: engines={best.engines} feeders={best.feeders} fraction={best.fraction:.3f} "
        f"steady={best.steady:.3f} cpu_ms_per_request={best.cpu_ms_per_request:.2f}"
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=_ints, default=[4, 16, 64], help="engine counts, e.g. 4,16,64")
    p.add_argument(
        "--feeders",
        type=_ints,
        default=[1],
        help="feeder process counts to run each engine count with, e.g. 1,2 (each must divide "
        "the engine count; larger ones are skipped where they do not)",
    )
    p.add_argument("--requests-per-engine", type=int, default=100)
    p.add_argument(
        "--rate", type=float, default=60.0, help="total engine capacity per row, requests/s"
    )
    p.add_argument(
        "--time-scale", type=float, default=None, help="fixed engine speed instead of --rate"
    )
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument(
        "--engine-procs", type=int, default=1, help="processes the engines are spread over"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="40 requests per engine")
    # internal: the child processes
    p.add_argument("--role", choices=["sweep", "engines", "feed"], default="sweep")
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--requests-file", default="", help=argparse.SUPPRESS)
    p.add_argument("--urls", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.requests_per_engine = 40
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "engines":
        serve_engines(args)
        return
    if args.role == "feed":
        feed(args)
        return
    sys.path.insert(0, str(HERE))
    from bench_pool import build_workload  # noqa: PLC0415 - a sibling script, not a package

    plan = [(n, k) for k in args.feeders for n in args.engines if n % k == 0]
    if not plan:
        sys.exit(
            f"bench_pool_sweep: no engine count in {args.engines} splits evenly over "
            f"{args.feeders} feeders; give --feeders values that divide an engine count"
        )
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="lowtide-pool-sweep-") as tmp:
        workload = build_workload(args.requests_per_engine * max(args.engines), args.seed)
        rate1 = per_engine_rate(workload, args.max_num_seqs)
        for n, k in plan:
            ts = args.time_scale or args.rate / (n * rate1)
            requests = workload.head(args.requests_per_engine * n)
            procs = min(args.engine_procs, n)
            t = time.monotonic()
            row = run_row(requests, n, k, procs, ts, args, Path(tmp))
            rows.append(row)
            print(
                f"  {n} engines, {k} feeder(s): {row.rps:.1f} req/s of "
                f"{row.capacity_rps:.1f} ({row.fraction:.3f}, steady {row.steady:.3f}), "
                f"{row.cpu_ms_per_request:.2f} feeder CPU ms/request, limited by "
                f"{row.limited_by}; {time.monotonic() - t:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    report(rows, args, started)


if __name__ == "__main__":
    main()
