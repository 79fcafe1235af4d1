"""Memory a query freed goes back to the system at once (lowtide/allocators.py).

Each probe is a process of its own, started as a user's shell starts `lowtide run`: what
counts is what importing lowtide sets before DuckDB and polars load. The figures are the
process's own resident memory right after a big table and a big frame are gone, never time.
"""

from __future__ import annotations

import os
import subprocess
import sys

AFTER_A_BIG_QUERY = """
import lowtide, duckdb, polars as pl

def rss_mb():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024

con = duckdb.connect()
before = rss_mb()
con.execute("CREATE TABLE t AS SELECT i, i::VARCHAR AS s FROM range(5000000) t(i)")
con.execute("SELECT s, count(*) FROM t GROUP BY s ORDER BY 2 LIMIT 1").fetchall()
con.execute("DROP TABLE t")
frame = pl.DataFrame({"s": pl.arange(0, 5_000_000, eager=True).cast(pl.String)})
frame.group_by("s").agg(pl.len())
del frame
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) // 1024 - before
print(peak, rss_mb() - before)
"""

PRINT_SETTINGS = """
import os, lowtide
print(os.environ["DUCKDB_JE_MALLOC_CONF"], os.environ["_RJEM_MALLOC_CONF"])
"""


def _probe(code: str, **conf: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.endswith("MALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, **conf}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_duckdb_and_polars_give_freed_memory_back() -> None:
    peak, kept = (int(v) for v in _probe(AFTER_A_BIG_QUERY).split())
    # measured: 102 MiB kept of 837 at the top; with jemalloc's own settings (pages kept for
    # 10 s) all 1,359 MiB stayed
    assert peak > 200, peak
    assert kept * 4 < peak, (peak, kept)


def test_a_user_s_own_allocator_settings_are_kept() -> None:
    assert _probe(PRINT_SETTINGS, DUCKDB_JE_MALLOC_CONF="narenas:2").split() == [
        "narenas:2",
        "dirty_decay_ms:0,muzzy_decay_ms:0",
    ]
