"""Provider keys are left nowhere: every backend runs through the CLI (`python -m lowtide.cli`)
with a recognisable fake key that the provider it talks to requires, then every byte a run leaves
behind is scanned for it: the state file, the published file, the work directory, exports and
reports, the Prefect server's database (and its artifacts, logs and flow runs read through the
Prefect API), and every command's stdout and stderr.

The Prefect server is a dedicated `prefect server start` with its own PREFECT_HOME, so its
SQLite file holds only these runs. DuckDB and Parquet files are compressed, so the scanner reads
their values as well as their bytes; `test_the_scanner_finds_a_planted_key` proves it finds a key
planted in each kind of file. The table is written to docs/reliability.md."""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.engine import EngineConfig
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.vllm_pool import start_engines
from tests.integration.conftest import lowtide_cli, write_job
from tests.key_guard import RequireKey
from tests.reliability_doc import write_section

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

_SQLITE = b"SQLite format 3\x00"
_DUCKDB_MAGIC = b"DUCK"  # bytes 8..12 of a DuckDB database file


# -- the scanner -----------------------------------------------------------------------------------


@dataclass
class Scan:
    """Where a needle was looked for and where it was found."""

    files: int = 0
    bytes: int = 0
    values: int = 0  # files also read value by value (DuckDB, Parquet, SQLite)
    texts: int = 0  # command outputs and API answers
    hits: list[str] = field(default_factory=list)

    def text(self, label: str, text: str, needles: tuple[str, ...]) -> None:
        self.texts += 1
        self.bytes += len(text.encode())
        if any(n in text for n in needles):
            self.hits.append(label)


def _needles(key: str) -> tuple[str, ...]:
    """The key, its random part alone, and the random part base64-encoded (as in a Basic or
    logged header)."""
    secret = key.rsplit("-", 1)[-1]
    return key, secret, base64.b64encode(key.encode()).decode()[:24]


def scan_tree(root: Path, key: str, scan: Scan | None = None) -> Scan:
    """Every file under `root`: its raw bytes, and for a DuckDB, Parquet or SQLite file every
    value of every table as text."""
    scan = scan or Scan()
    needles = _needles(key)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        data = path.read_bytes()
        scan.files += 1
        scan.bytes += len(data)
        found = any(n.encode() in data for n in needles)
        values = _values(path, data)
        if values is not None:
            scan.values += 1
            found = found or any(n in values for n in needles)
        if found:
            scan.hits.append(str(path.relative_to(root)))
    return scan


def _values(path: Path, data: bytes) -> str | None:
    if data[8:12] == _DUCKDB_MAGIC:
        return _duckdb_values(path)
    if path.suffix == ".parquet" or data[:4] == b"PAR1":
        return repr(pl.read_parquet(path).rows())
    if data.startswith(_SQLITE):
        return _sqlite_values(path)
    return None


def _duckdb_values(path: Path) -> str:
    """Every value of a DuckDB file, read from a copy (with its WAL) so no lock is taken."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "copy.duckdb"
        shutil.copyfile(path, copy)
        wal = path.with_name(path.name + ".wal")
        if wal.is_file():
            shutil.copyfile(wal, copy.with_name(copy.name + ".wal"))
        con = duckdb.connect(str(copy))
        try:
            tables = con.execute(
                "SELECT schema_name, table_name FROM duckdb_tables() "
                "UNION ALL SELECT schema_name, view_name FROM duckdb_views() WHERE NOT internal"
            ).fetchall()
            out = []
            for schema, table in tables:
                out.append(repr(con.execute(f'SELECT * FROM "{schema}"."{table}"').fetchall()))
            return "\n".join(out)
        finally:
            con.close()


def _sqlite_values(path: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "copy.db"
        shutil.copyfile(path, copy)
        for suffix in ("-wal", "-shm"):
            side = path.with_name(path.name + suffix)
            if side.is_file():
                shutil.copyfile(side, copy.with_name(copy.name + suffix))
        con = sqlite3.connect(copy)
        try:
            names = [
                r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            ]
            return "\n".join(
                repr(con.execute(f'SELECT * FROM "{name}"').fetchall()) for name in names
            )
        finally:
            con.close()


def _sqlite_counts(path: Path, tables: tuple[str, ...]) -> dict[str, int]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0] for t in tables}
    finally:
        con.close()


# -- a dedicated Prefect server -----------------------------------------------------------------


@dataclass
class PrefectServer:
    url: str
    home: Path
    process: subprocess.Popen[bytes]

    @property
    def database(self) -> Path:
        return self.home / "prefect.db"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_until_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    """Until the server answers its health check (the module's timeout bounds a hang); a
    server that exits first fails the test."""
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None:
            pytest.fail(f"prefect server did not start (exit {process.poll()})")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """`prefect server start` with its own PREFECT_HOME (and so its own SQLite file)."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
        + ["--port", str(port), "--no-ui", "--analytics-off", "--no-scheduler", "--no-late-runs"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        _wait_until_healthy(url, process)
    except BaseException:  # the module's timeout, Ctrl-C: no server left running
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    try:
        yield PrefectServer(url=url, home=home, process=process)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _api(server: PrefectServer) -> dict[str, list[dict[str, Any]]]:
    """Artifacts, logs, flow runs and task runs as the Prefect API returns them."""
    from prefect.client.orchestration import SyncPrefectClient

    def every(read: Callable[..., list[Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while page := read(limit=200, offset=len(out)):
            out += [item.model_dump(mode="json") for item in page]
        return out

    with SyncPrefectClient(server.url) as client:
        return {
            "artifacts": every(client.read_artifacts),
            "logs": every(client.read_logs),
            "flow_runs": every(client.read_flow_runs),
            "task_runs": every(client.read_task_runs),
        }


def _save_secret_block(server: PrefectServer, name: str, key: str) -> None:
    """A Secret block on the dedicated server, saved by another process as an operator would."""
    code = (
        "import sys\nfrom prefect.blocks.system import Secret\n"
        "Secret(value=sys.argv[2]).save(sys.argv[1])\n"
    )
    env = {**os.environ, "PREFECT_API_URL": server.url}
    done = subprocess.run(
        [sys.executable, "-c", code, name, key],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


# -- the runs -------------------------------------------------------------------------------------

CASES = (
    "openai",
    "anthropic",
    "vllm",
    "openai + Secret block",
    "vllm + Secret block",
    "openai, key refused (401)",
)
RESULTS: dict[str, dict[str, Any]] = {}


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The shared `lowtide_cli` with the case's environment as the whole one (which keys exist
    is the point of these tests)."""
    return lowtide_cli(*args, cwd=cwd, env=env, timeout=600, inherit=False)


@pytest.mark.parametrize("case", CASES)
def test_a_run_leaves_its_key_nowhere(
    case: str, tmp_path: Path, prefect_server: PrefectServer
) -> None:
    key = f"sk-canary-{secrets.token_hex(16)}"
    backend = case.split()[0].rstrip(",")
    block = f"canary-{secrets.token_hex(4)}" if "block" in case else None
    replace = {"extra_body = {}\n": f'extra_body = {{}}\napi_key_block = "{block}"\n'}
    if backend == "vllm":  # the pool's key: [pool] api_key_block
        extra = f'[pool]\napi_key_block = "{block}"\n' if block else ""
        job = write_job(tmp_path, rows=24, eval_rows=4, extra=extra)
    else:
        job = write_job(tmp_path, rows=24, eval_rows=4, replace=replace if block else None)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env |= {
        "PREFECT_API_URL": prefect_server.url,
        "PREFECT_HOME": str(tmp_path / "client-prefect-home"),
        "PREFECT_LOGGING_LEVEL": "DEBUG",
        "PREFECT_LOGGING_TO_API_ENABLED": "true",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "lowtide,flows,tasks",
        "LOWTIDE_KEEP_WORK_DIR": "1",  # a finished run removes them; keep them to scan
    }
    outputs: list[tuple[str, str]] = []
    with ExitStack() as stack:
        if backend == "vllm":
            ledger = BillingLedger()
            pool = stack.enter_context(
                start_engines(2, EngineConfig(time_scale=50.0), api_key=key, ledger=ledger)
            )
            env |= {"LOWTIDE_VLLM_URLS": ",".join(pool.urls)}
            if block:
                _save_secret_block(prefect_server, block, key)
            else:
                env["LOWTIDE_VLLM_API_KEY"] = key
            provider_calls = lambda: len(ledger.executions())  # noqa: E731
        else:
            emu = Emulator(EmulatorConfig(time_scale=600.0, error_rate=0.0))
            refused = "refused" in case  # the provider wants another key: the error paths
            guard = RequireKey(emu.app, f"sk-other-{secrets.token_hex(8)}" if refused else key)
            emu.app = guard  # served wrapped: the emulator refuses any other key
            stack.enter_context(emu)
            variables = {"openai": "OPENAI", "anthropic": "ANTHROPIC"}[backend]
            url = emu.openai_base_url if backend == "openai" else emu.anthropic_base_url
            env[f"{variables}_BASE_URL"] = url
            if block:
                _save_secret_block(prefect_server, block, key)
            else:
                env[f"{variables}_API_KEY"] = key
            provider_calls = lambda: guard.refused if refused else guard.accepted  # noqa: E731
        run = _cli("run", str(job), "--backend", backend, env=env, cwd=tmp_path)
        outputs.append(("run", run.stdout + run.stderr))
        assert (run.returncode == 0) != ("refused" in case), run.stdout + run.stderr
        calls = provider_calls()
    assert calls > 0  # the provider was reached with the key (and, but for 401s, only with it)

    status = _cli("status", "--json", env=env, cwd=tmp_path)
    outputs.append(("status --json", status.stdout + status.stderr))
    (record,) = json.loads(status.stdout)
    run_id = record["run_id"]
    if "refused" in case:
        assert run.returncode == 2 and "401" in run.stderr, run.stdout + run.stderr
        # refused for the key, not for its rows: the run stays resumable with the 401 as its
        # error (kept in the state file: scanned below), no row failed for it
        assert record["status"] == "running" and not record["failed"], record
        assert "refused the API key (HTTP 401" in record["error"], record
        assert record["requests_sent"] == 0  # refused at the upload: nothing reached it
        done = _cli("status", run_id, env=env, cwd=tmp_path)
        outputs.append(("status RUN", done.stdout + done.stderr))
    else:
        assert run.returncode == 0, run.stdout + run.stderr
        assert record["status"] == "completed" and record["rows"] == 24 == record["succeeded"]
        _inspect(run_id, job, env, tmp_path, outputs)

    api = _api(prefect_server)
    assert api["artifacts"] and api["logs"] and api["flow_runs"]
    scan = scan_tree(tmp_path, key)  # state, published file, work dir, exports, client home
    files_here = scan.files
    scan_tree(prefect_server.home, key, scan)  # the server's SQLite file (values and bytes)
    needles = _needles(key)
    for label, text in outputs:
        scan.text(label, text, needles)
    for place, items in api.items():
        scan.text(f"Prefect API {place}", json.dumps(items), needles)
    counts = _sqlite_counts(
        prefect_server.database, ("artifact", "log", "flow_run", "task_run", "events")
    )
    RESULTS[case] = {
        "files": scan.files,
        "files_here": files_here,
        "bytes": scan.bytes,
        "values": scan.values,
        "texts": scan.texts,
        "hits": list(scan.hits),
        "calls": calls,
        "prefect": counts,
    }
    # the state file, the published file and the work dir are among what was scanned (a
    # refused key publishes nothing: its run waits, resumable, for a key the provider takes)
    scanned = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert {"state.duckdb"} <= scanned
    assert ("lowtide.duckdb" in scanned) != ("refused" in case)
    assert any((tmp_path / "work").rglob("*.parquet")) or "refused" in case
    assert scan.hits == [], f"the key {key} was found in {scan.hits}"


def _inspect(
    run_id: str, job: Path, env: dict[str, str], cwd: Path, outputs: list[tuple[str, str]]
) -> None:
    """What an analyst or operator does after a run: status, exports, report, QA, SQL."""
    exports = cwd / "exports"
    for fmt in ("csv", "jsonl", "parquet"):
        out = str(exports / f"run.{fmt}")
        done = _cli("export", run_id, "--format", fmt, "--out", out, env=env, cwd=cwd)
        outputs.append((f"export {fmt}", done.stdout + done.stderr))
        assert done.returncode == 0, done.stderr
    for args in (
        ["status", run_id],
        ["report", str(job), "--out", str(exports / "report.html")],
        ["qa", "export", run_id, "--out", str(exports / "qa.csv")],
        ["sql", "SELECT * FROM support_intents"],
    ):
        done = _cli(*args, env=env, cwd=cwd)
        outputs.append((" ".join(args[:2]), done.stdout + done.stderr))
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_scanner_finds_a_planted_key(tmp_path: Path) -> None:
    """The scanner can fail: a key planted in each kind of file is found there, and only there
    (in DuckDB among 20,000 compressible rows, in Parquet, in SQLite, in a log, in a WAL)."""
    key = f"sk-canary-{secrets.token_hex(16)}"
    clean = tmp_path / "clean.log"
    clean.write_text("nothing to see\n")
    (tmp_path / "nested" / "deeper").mkdir(parents=True)
    (tmp_path / "nested" / "deeper" / "run.log").write_text(f"header: Bearer {key}\n")
    con = duckdb.connect(str(tmp_path / "state.duckdb"))
    con.execute(
        "CREATE TABLE t AS SELECT 'row ' || (i % 7) AS v FROM range(20000) r(i) UNION ALL SELECT ?",
        [f"header {key}"],
    )
    con.close()
    con = duckdb.connect(str(tmp_path / "clean.duckdb"))
    con.execute("CREATE TABLE t AS SELECT 'row ' || (i % 7) AS v FROM range(20000) r(i)")
    con.close()
    pl.DataFrame({"v": ["x"] * 5000 + [key]}).write_parquet(tmp_path / "part.parquet")
    lite = sqlite3.connect(tmp_path / "prefect.db")
    lite.execute("CREATE TABLE log (message TEXT)")
    lite.execute("INSERT INTO log VALUES (?)", [f"using {key}"])
    lite.commit()
    lite.close()
    (tmp_path / "auth.txt").write_text(base64.b64encode(key.encode()).decode())
    (tmp_path / "masked.txt").write_text("key=" + key.rsplit("-", 1)[-1])
    scan = scan_tree(tmp_path, key)
    assert sorted(scan.hits) == sorted(
        [
            "nested/deeper/run.log",
            "state.duckdb",
            "part.parquet",
            "prefect.db",
            "auth.txt",
            "masked.txt",
        ]
    )
    assert scan.values == 4  # two DuckDB files, one Parquet, one SQLite read value by value
    text = Scan()
    text.text("stderr", f"error: bad key {key}", _needles(key))
    assert text.hits == ["stderr"]
    RESULTS["planted"] = {"hits": len(scan.hits), "files": scan.files}


def test_write_the_secrets_table() -> None:
    """Runs after the cases (file order): the table in docs/reliability.md."""
    if set(CASES) - set(RESULTS) or "planted" not in RESULTS:
        pytest.skip("the cases did not all run in this session")
    lines = [
        "Each backend through `python -m lowtide.cli run` with a fresh key `sk-canary-<32 hex>` "
        "that its provider requires (calls without it get 401), against a dedicated "
        "`prefect server start` (logs sent to it at DEBUG). Then `status --json`, `status RUN`, "
        "`export` (csv, jsonl, parquet), `report`, `qa export` and `sql`. Looked for: the key, "
        "its random part alone, and its base64 form.",
        "",
        "| backend | key from | provider calls with the key (refused, in the 401 case) | places scanned | files | "
        "bytes | files read value by value | outputs and API answers | Prefect rows "
        "on the shared server, cumulative (artifacts / logs / flow runs / task runs / events) | key found |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    source = {
        "openai": "OPENAI_API_KEY",
        "anthropic": "ANTHROPIC_API_KEY",
        "vllm": "LOWTIDE_VLLM_API_KEY",
        "openai + Secret block": "Prefect Secret block",
        "vllm + Secret block": "Prefect Secret block ([pool] api_key_block)",
        "openai, key refused (401)": "OPENAI_API_KEY (the provider wants another)",
    }
    common = (
        "state file + WAL, published file, work dir, client PREFECT_HOME, Prefect server DB, "
        "Prefect API (artifacts, logs, flow and task runs), stdout/stderr"
    )
    for case in CASES:
        r = RESULTS[case]
        p = r["prefect"]
        refused = "refused" in case  # its run waits for a key: nothing published or exported
        places = common.replace("published file, ", "") if refused else common
        extra = " (no published file, no exports)" if refused else ", exports, report"
        prefect = " / ".join(
            str(p[t]) for t in ("artifact", "log", "flow_run", "task_run", "events")
        )
        lines.append(
            f"| {case} | {source[case]} | {r['calls']} | {places}{extra} | {r['files']} | "
            f"{r['bytes']:,} | {r['values']} | {r['texts']} | {prefect} | {len(r['hits'])} |"
        )
    planted = RESULTS["planted"]
    lines += [
        "",
        f"The scanner's own check: a key planted in {planted['hits']} of {planted['files']} files "
        "(a DuckDB table of 20,000 compressible rows, Parquet, SQLite, a nested log, base64, the "
        f"random part alone) is found in all {planted['hits']} and nowhere else.",
    ]
    write_section("secrets", "Secrets", "\n".join(lines))
