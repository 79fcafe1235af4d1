"""CPU-side cost of lowtide's stages on N synthetic rows, next to the hand-written floor.

Runs the real stage functions (load → chunk → dedupe → assemble → write-ahead manifest into a
real DuckDB state file → build one shard's lines → parse a full set of answers) in one process
and prints a table of seconds per stage, rows/s and peak RSS. With ../shared/bench present the
rows are the reference's generated data and the floor is measured in the same invocation (the
reference's CPU plus one tokenizer pass over the rows that need counting, as `make bench-scale`
does); without it the rows are synthetic and there is no floor (ratio_to_floor=nan). The whole
`lowtide run` is measured by bench/bench_scale.py.

    .venv/bin/python bench/bench_pipeline.py --rows 100000
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import orjson
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_scale  # noqa: E402

from lowtide.jobspec import load_job  # noqa: E402
from lowtide.store import Store  # noqa: E402
from tasks.assemble import line_template, plan_batches, template_id  # noqa: E402
from tasks.chunk import chunk_units  # noqa: E402
from tasks.dedupe import request_keys, unique_requests  # noqa: E402
from tasks.load import normalise_input, read_table  # noqa: E402
from tasks.parse import parse_results  # noqa: E402

JOB = Path(__file__).resolve().parents[1] / "data" / "jobs" / "support-intents.toml"
WORDS = [
    "refund",
    "order",
    "shipping",
    "late",
    "parcel",
    "card",
    "billing",
    "charged",
    "twice",
    "account",
    "locked",
    "password",
    "cancel",
    "subscription",
    "address",
    "change",
    "damaged",
    "broken",
    "box",
    "please",
    "help",
    "thanks",
    "Zoë",
    "café",
    "€12.50",
    "naïve",
]


def synthetic_csv(rows: int, path: Path) -> None:
    """Long-tailed lengths, ~6% exact and ~2% case/space duplicates, some non-ASCII."""
    rng = random.Random(7)
    texts: list[str] = []
    for _i in range(rows):
        r = rng.random()
        if texts and r < 0.06:
            texts.append(rng.choice(texts))
        elif texts and r < 0.08:
            texts.append("  " + rng.choice(texts).upper())
        else:
            n = min(int(rng.lognormvariate(3.6, 0.9)) + 3, 6000)
            texts.append(" ".join(rng.choice(WORDS) for _ in range(n)))
    pl.DataFrame(
        {
            "message_id": [f"m{i:08d}" for i in range(rows)],
            "body": texts,
            "channel": ["email"] * rows,
        }
    ).write_csv(path)


def measured_floor(ref: Path, python: Path, data: Path, rows: int) -> float:
    """The reference's CPU seconds plus one tokenizer pass, measured now on the same data."""
    reference = bench_scale.timed(
        [str(python), str(ref / "limit_e2e.py"), "--rows", str(rows), "--hash", "xxh3"]
        + ["--no-payload", "--runs", "1"]
    )
    if reference["rc"] != 0:
        sys.exit(f"reference failed:\n{reference['stderr'][-2000:]}")
    tok = bench_scale.timed(
        [sys.executable, "-c", bench_scale.TOKENIZER_FLOOR, str(data / "input.parquet"), "1024"]
    )
    return float(reference["cpu_s"]) + float(tok["stdout"].split()[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    args = ap.parse_args()
    job = load_job(JOB)
    work = Path(tempfile.mkdtemp(prefix="lowtide-bench-"))
    csv = work / "input.csv"
    id_column, text_column, columns = "message_id", "body", ["channel"]
    ref = bench_scale.reference_dir()
    floor = float("nan")
    if ref is None:
        synthetic_csv(args.rows, csv)
    else:
        python = bench_scale.lab_python(ref)
        data = bench_scale.data_dir(ref, python, args.rows)
        csv = data / "input.parquet"
        id_column, text_column, columns = "id", "text", []
        floor = measured_floor(ref, python, data, args.rows)
    times: dict[str, float] = {}

    def timed(name: str, fn):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = fn()
        times[name] = time.perf_counter() - t
        return out

    rows = timed(
        "load",
        lambda: normalise_input(
            read_table(str(csv)),
            where=str(csv),
            id_column=id_column,
            text_column=text_column,
            columns=columns,
        ),
    )
    units = timed("chunk", lambda: chunk_units(rows, max_tokens=1024, overlap=64))
    uniq = timed(
        "dedupe",
        lambda: unique_requests(
            request_keys(units, job.prompt.user_template, job.prompt_fingerprint())
        ),
    )
    reqs, batches, members = timed(
        "assemble",
        lambda: plan_batches(
            job, "bench", uniq, backend="openai", max_requests=50_000, max_bytes=200 * 2**20
        ),
    )
    store = Store(work / "state.duckdb")
    store.has_manifest("bench")  # opens and migrates the file outside the timing

    def manifest() -> None:
        store.save_template(template_id(job), *line_template(job))
        store.write_manifest("bench", reqs, batches, members)

    timed("manifest (DuckDB)", manifest)
    lines = timed("one shard's lines", lambda: store.batch_lines(batches["batch_id"][0]))
    answer = orjson.dumps(
        {"intent": "refund_request", "urgency": "normal", "summary": "x"}
    ).decode()
    results = pl.DataFrame(
        {
            "custom_id": uniq["custom_id"],
            "status": "answered",
            "raw_text": answer,
            "finish_reason": "stop",
            "error": None,
            "input_tokens": 900,
            "cached_tokens": 0,
            "output_tokens": 20,
        },
        schema_overrides={"error": pl.String},
    )
    timed("parse + validate", lambda: parse_results(results, job.output_schema))
    total = sum(times.values())
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"## lowtide stages on {args.rows:,} rows ({os.cpu_count()} cores, Python "
        f"{platform.python_version()}, {platform.machine()})\n"
    )
    print(
        f"units {units.height:,}, unique requests {uniq.height:,}, shards {batches.height}, "
        f"first shard {len(lines):,} lines\n"
    )
    print("| stage | seconds |\n|---|---:|")
    for name, sec in times.items():
        print(f"| {name} | {sec:.2f} |")
    print(f"| **total** | **{total:.2f}** |\n")
    print(
        f"rows/s {args.rows / total:,.0f}; peak RSS {peak_mb:,.0f} MB; floor measured now "
        f"{floor:.1f} s CPU (ratio {total / floor:.2f}; the floor has no cache or manifest)"
        if floor == floor
        else f"rows/s {args.rows / total:,.0f}; peak RSS {peak_mb:,.0f} MB; no floor: "
        "../shared/bench is not here (synthetic rows)"
    )
    print(f"pipeline: rows={args.rows} seconds={total:.2f} ratio_to_floor={total / floor:.2f}")


if __name__ == "__main__":
    main()
