"""The whole `lowtide run` at scale, beside the hand-written floor, in one invocation.

    .venv/bin/python bench/bench_scale.py --rows 100000        (make bench-scale ROWS=N)

1. Data and floor from ../shared/bench (skipped, with the reason, when it is absent): the
   reference `limit_e2e.py --hash xxh3 --no-payload` on the generated rows, and one bpe-openai
   pass over the rows longer than the chunk budget in bytes (the only rows that need counting).
   Each is measured twice, before the first night and after the third, and the ratio takes the
   mean of each: on this shared virtual machine one measurement of the same code moved by a
   quarter within an hour (the tokenizer pass at 1M rows: 35.8-57.0 s in one day, 57.0 and
   44.7 s in one bench), so a floor measured once, minutes away from the night it is compared
   with, said more about the minute than about lowtide. (Not between the nights: the
   reference's 6 GB pushed the state out of the page cache, and the second night's wall time
   went from 1 to 6.5 s.)
2. The emulator in its own process (`lowtide emulator --time-scale 2000 --error-rate 0`).
3. Three nights of the real CLI, template `{text}`: the first; the second over the same input;
   a third with 1% of rows appended and 1% changed.

No Prefect server is configured, so the CLI runs its flows in-process, as a user's does
(lowtide/orchestration.py). CPU is the process tree's: lowtide and anything it starts (this
process becomes a child subreaper, so a Prefect server that a Secret block would start is reaped
and counted here) and nothing of the emulator. Stage seconds and task-run counts (task calls:
what Prefect would record as task runs) come from the run's LOWTIDE_STAGE_TIMINGS file. The last
line is the contract:

    scale: rows=N total_s=… reference_s=… tokenizer_s=… ratio=… peak_rss_mb=… …
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
LABELS = ["billing", "technical", "account", "shipping", "refund", "other"]
CHUNK_TOKENS = 1024
_PR_SET_CHILD_SUBREAPER = 36

TOKENIZER_FLOOR = """
import sys, time, polars as pl
from bpe_openai import get_encoding
enc = get_encoding("o200k_base")
texts = pl.read_parquet(sys.argv[1], columns=["text"]).filter(
    pl.col("text").str.len_bytes() > int(sys.argv[2]))["text"].to_list()
started = time.process_time()
n = 0
for t in texts:
    for i in range(0, len(t), 50_000):   # bpe-openai refuses one very long input
        n += len(enc.encode(t[i:i + 50_000]))
print(len(texts), n, time.process_time() - started)
"""


def reference_dir() -> Path | None:
    here = os.environ.get("LOWTIDE_BENCH_REF")
    path = Path(here) if here else REPO.parent / "shared" / "bench"
    return path if (path / "limit_e2e.py").is_file() else None


def lab_python(ref: Path) -> Path:
    lab = Path(os.environ.get("PERF_LAB") or Path(tempfile.gettempdir()) / "perf-lab")
    python = lab / "venv" / "bin" / "python"
    if not python.exists():
        subprocess.run(["bash", str(ref / "setup_env.sh")], check=True)
    return python


def data_dir(ref: Path, python: Path, rows: int) -> Path:
    lab = Path(os.environ.get("PERF_LAB") or Path(tempfile.gettempdir()) / "perf-lab")
    out = lab / "data" / f"rows_{rows}"
    if not (out / "input.parquet").is_file():
        subprocess.run([str(python), str(ref / "gen_data.py"), "--rows", str(rows)], check=True)
    return out


def timed(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> dict:
    """Run to the end; wall seconds, CPU seconds of the whole tree (orphans reaped here), peak
    RSS of the largest process, and its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # its own peak RSS, not an earlier night's
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    _reap_orphans()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "rc": proc.returncode,
        "wall_s": wall,
        "cpu_s": cpu,
        "sys_s": after.ru_stime - before.ru_stime,
        "page_faults": after.ru_minflt - before.ru_minflt,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "stdout": stdout,
        "stderr": stderr,
    }


_KEEP: set[int] = set()  # the emulator: a child that must outlive every night


def _reap_orphans() -> None:
    """Wait for descendants that outlived their parent (Prefect's server, told to stop when
    lowtide exits) so their CPU counts; give up after 60 s."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = [p for p in _children() if p not in _KEEP]
        if not kids:
            return
        for pid in kids:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    time.sleep(0.1)
            except ChildProcessError:
                pass


def _children() -> list[int]:
    me, kids = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                kids.append(int(entry.name))
    return kids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_job(work: Path, input_path: Path) -> Path:
    schema = {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": LABELS},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["label", "confidence"],
        "additionalProperties": False,
    }
    (work / "schema.json").write_text(json.dumps(schema))
    job = work / "scale.toml"
    job.write_text(
        f"""name = "scale"
[input]
path = "{input_path}"
id_column = "id"
text_column = "text"
[chunk]
max_tokens = {CHUNK_TOKENS}
[prompt]
system = "Classify the support ticket; answer with JSON."
user_template = "{{text}}"
[output]
name = "ticket"
schema_file = "schema.json"
[model]
backend = "emulator"
name = "gpt-4o-mini"
max_tokens = 64
[qa]
sample_rate = 0.0
[cost]
price_table = "{REPO / "data" / "prices.csv"}"
"""
    )
    return job


def stage_seconds(
    timings: Path,
) -> tuple[dict[str, float], int, dict[str, float], dict[str, float]]:
    """Wall seconds per task name (summed), the number of task calls (what Prefect would
    record as task runs), CPU seconds per task name and the kernel's part of them, of one
    in-process run, from its LOWTIDE_STAGE_TIMINGS file."""
    if not timings.is_file():  # an unchanged night returns before any flow or task
        return {}, 0, {}, {}
    stages: dict[str, float] = {}
    cpu: dict[str, float] = {}
    kernel: dict[str, float] = {}
    calls = 0
    for line in timings.read_bytes().splitlines():
        entry = json.loads(line)
        if entry["kind"] != "task":
            continue
        calls += 1
        stages[entry["name"]] = stages.get(entry["name"], 0.0) + float(entry["seconds"])
        cpu[entry["name"]] = cpu.get(entry["name"], 0.0) + float(entry.get("cpu_s", 0.0))
        kernel[entry["name"]] = kernel.get(entry["name"], 0.0) + float(entry.get("sys_s", 0.0))
    return stages, calls, cpu, kernel


def peak_stage(timings: Path) -> str:
    """The stage in which the run's process first reached its peak memory (timing lines carry
    the process's high-water mark so far)."""
    if not timings.is_file():
        return "-"
    tasks = [e for e in map(json.loads, timings.read_bytes().splitlines()) if e["kind"] == "task"]
    marks = [(e["name"], e["peak_rss_mb"]) for e in tasks if "peak_rss_mb" in e]
    if not marks:
        return "-"
    top = max(mb for _, mb in marks)
    return next(name for name, mb in marks if mb == top)


def night(name: str, job: Path, env: dict[str, str], work: Path) -> dict:
    # no Prefect server is configured here, so the CLI runs the flow in-process (as a user's
    # would) and writes each stage's seconds to this file
    timings = work / f"stages-{re.sub(r'[^a-z]+', '-', name)}.jsonl"
    result = timed(
        [str(VENV_BIN / "lowtide"), "run", str(job)],
        env={**env, "LOWTIDE_STAGE_TIMINGS": str(timings)},
        cwd=work,
    )
    if result["rc"] != 0:
        sys.exit(f"{name}: lowtide run exited {result['rc']}:\n{result['stderr'][-3000:]}")
    status = subprocess.run(
        [str(VENV_BIN / "lowtide"), "status", "--json"],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    )
    run = json.loads(status.stdout)[0]
    if run.get("unchanged_from") is None and not timings.is_file():
        sys.exit(
            f"{name}: the run left no stage timings, so it went through a Prefect server (a "
            "profile or ./prefect.toml names one?): run the bench without one"
        )
    stages, task_runs, stage_cpu, stage_sys = stage_seconds(timings)
    sizes = {k: Path(env[k]).stat().st_size for k in ("LOWTIDE_STATE", "LOWTIDE_DB")}
    # the state is the file and its folder of requests' messages still to answer
    messages = Path(env["LOWTIDE_STATE"] + ".messages")
    if messages.is_dir():
        sizes["LOWTIDE_STATE"] += sum(f.stat().st_size for f in messages.iterdir())
    return {
        **result,
        "name": name,
        "run": run,
        "stages": stages,
        "stage_cpu": stage_cpu,
        "stage_sys": stage_sys,
        "task_runs": task_runs,
        "peak_stage": peak_stage(timings),
        "state_mb": sizes["LOWTIDE_STATE"] / 2**20,
        "published_mb": sizes["LOWTIDE_DB"] / 2**20,
    }


def change_input(src: Path, dst: Path, share: float) -> None:
    """`share` of rows appended (new ids) and `share` changed (new text), written to `dst`."""
    import polars as pl

    frame = pl.read_parquet(src)
    n = max(1, int(frame.height * share))
    changed = frame.with_columns(
        pl.when(pl.int_range(pl.len()) % (frame.height // n) == 0)
        .then(pl.col("text") + " (updated)")
        .otherwise(pl.col("text"))
        .alias("text")
    )
    appended = frame.head(n).with_columns(
        ("new-" + pl.col("id")).alias("id"), (pl.col("text") + " (new)").alias("text")
    )
    pl.concat([changed, appended]).write_parquet(dst)


def change_input_apart(src: Path, dst: Path, share: float) -> None:
    """`change_input` in a process of its own. Reading a million rows here would raise this
    process's memory, and Linux hands a process's high-water mark to the children it starts
    (across exec): the next night's peak RSS read 2.9 GB where its own stages peaked at 2.0."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "from bench_scale import change_input; from pathlib import Path; "
        f"change_input(Path({str(src)!r}), Path({str(dst)!r}), {share!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    ref = reference_dir()
    if ref is None:
        print(
            "scale: skipped: the reference (../shared/bench, or LOWTIDE_BENCH_REF) is not here; "
            "it generates the data and measures the floor"
        )
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    python = lab_python(ref)
    data = data_dir(ref, python, args.rows)

    floors = [measure_floor(ref, python, data, args.rows)]
    work = Path(tempfile.mkdtemp(prefix="lowtide-scale-"))
    try:
        input_path = work / "input.parquet"
        shutil.copyfile(data / "input.parquet", input_path)
        job = write_job(work, input_path)
        emu_port = free_port()
        emulator = subprocess.Popen(
            [str(VENV_BIN / "lowtide"), "emulator", "--port", str(emu_port)]
            + ["--time-scale", "2000", "--error-rate", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _KEEP.add(emulator.pid)
        _wait_for_port(emu_port)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWTIDE_", "PREFECT_API"))}
        env.update(
            LOWTIDE_STATE=str(work / "state.duckdb"),
            LOWTIDE_DB=str(work / "lowtide.duckdb"),
            LOWTIDE_WORK_DIR=str(work / "work"),
            LOWTIDE_EMULATOR_URL=f"http://127.0.0.1:{emu_port}",
            PREFECT_HOME=str(work / "prefect"),
            COLUMNS="200",
        )
        try:
            nights = [night("first", job, env, work), night("second (same input)", job, env, work)]
            change_input_apart(data / "input.parquet", input_path, 0.01)
            nights.append(night("third (+1% rows, 1% changed)", job, env, work))
        finally:
            emulator.terminate()
            emulator.wait(30)
        floors.append(measure_floor(ref, python, data, args.rows))
        report(args.rows, floors, nights)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def measure_floor(ref: Path, python: Path, data: Path, rows: int) -> dict:
    """One measurement of the floor: the reference's CPU (and wall, peak) and the tokenizer
    pass's CPU over the rows that need counting."""
    reference = timed(
        [str(python), str(ref / "limit_e2e.py"), "--rows", str(rows), "--hash", "xxh3"]
        + ["--no-payload", "--runs", "1"]
    )
    if reference["rc"] != 0:
        sys.exit(f"reference failed:\n{reference['stderr'][-2000:]}")
    tok = timed([sys.executable, "-c", TOKENIZER_FLOOR, str(data / "input.parquet"), "1024"])
    long_rows, long_tokens, tok_cpu = tok["stdout"].split()
    return {
        "reference": reference,
        "tokenizer_s": float(tok_cpu),
        "long_rows": int(long_rows),
        "long_tokens": int(long_tokens),
    }


def _wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    sys.exit(f"the emulator did not open port {port} within 60 s")


def report(rows: int, floors: list[dict], nights: list[dict]) -> None:
    first, second, third = nights
    reference_s = statistics.mean(f["reference"]["cpu_s"] for f in floors)
    tokenizer_s = statistics.mean(f["tokenizer_s"] for f in floors)
    floor = reference_s + tokenizer_s
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, {_cpu_model()}, "
        f"Python {platform.python_version()}; rows={rows:,}"
    )
    said = lambda values: " / ".join(f"{v:.1f}" for v in values)  # noqa: E731
    walls = [f["reference"]["wall_s"] for f in floors]
    print(
        f"floor, measured before the first night and after the third (the mean of each "
        f"counts): reference CPU {said(f['reference']['cpu_s'] for f in floors)} s (wall "
        f"{said(walls)} s, peak {floors[0]['reference']['peak_rss_mb']:.0f} MB) + bpe-openai "
        f"over {floors[0]['long_rows']:,} rows longer than {CHUNK_TOKENS} bytes "
        f"({floors[0]['long_tokens']:,} tokens) {said(f['tokenizer_s'] for f in floors)} s; "
        f"{reference_s:.1f} + {tokenizer_s:.1f} = {floor:.1f} s"
    )
    stages = sorted({s for n in nights for s in n["stages"]})
    print(
        "\n| night | wall s | CPU s | peak RSS MB | requests sent | task runs | state MB | "
        "published MB | " + " | ".join(f"{s} s" for s in stages) + " |"
    )
    print("|" + "---|" * (8 + len(stages)))
    for n in nights:
        cells = [
            n["name"],
            f"{n['wall_s']:.1f}",
            f"{n['cpu_s']:.1f}",
            f"{n['peak_rss_mb']:.0f}",
            f"{n['run'].get('requests_sent') or 0:,}",
            str(n["task_runs"]),
            f"{n['state_mb']:.0f}",
            f"{n['published_mb']:.0f}",
        ] + [f"{n['stages'].get(s, 0.0):.1f}" for s in stages]
        print("| " + " | ".join(cells) + " |")
    print(
        "\nfirst night, CPU s of the run's process by stage (the rest: starting, Prefect, "
        f"waiting on the engine): {first['cpu_s'] - sum(first['stage_cpu'].values()):.1f}\n\n| "
        + " | ".join(first["stage_cpu"])
        + " |\n|"
        + "---|" * len(first["stage_cpu"])
        + "\n| "
        + " | ".join(f"{v:.1f}" for v in first["stage_cpu"].values())
        + " |\n| "
        + " | ".join(f"{first['stage_sys'].get(k, 0.0):.1f}" for k in first["stage_cpu"])
        + " |\n\n(second row: the kernel's part; of the whole tree's "
        f"{first['cpu_s']:.1f} s, {first['sys_s']:.1f} s in the kernel, "
        f"{first['page_faults']:,} pages touched afresh; its peak memory was reached in "
        f"{first['peak_stage']})"
    )
    size = lambda n: n["state_mb"] + n["published_mb"]  # noqa: E731
    print(
        f"\nscale: rows={rows} total_s={first['cpu_s']:.1f} "
        f"reference_s={reference_s:.1f} tokenizer_s={tokenizer_s:.1f} "
        f"ratio={first['cpu_s'] / floor:.2f} peak_rss_mb={first['peak_rss_mb']:.0f} "
        f"rerun_fraction={second['wall_s'] / first['wall_s']:.3f} "
        f"rerun_requests={second['run'].get('requests_sent') or 0} "
        f"incremental_fraction={third['wall_s'] / first['wall_s']:.3f} "
        f"incremental_requests={third['run'].get('requests_sent') or 0} "
        f"storage_growth={size(second) / size(first):.2f}"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
