"""Memory a query freed goes back to the system at once, not ~10 s later (lowtide/allocators.py).

Each probe is a process of its own, started as a user's shell starts `lowtide run`: what
counts is what importing lowtide sets before DuckDB and polars load. The figures are the
process's own resident memory after a big table and a big frame are gone, never time.
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
duck = rss_mb() - before
before = rss_mb()
frame = pl.DataFrame({"s": pl.arange(0, 5_000_000, eager=True).cast(pl.String)})
frame.group_by("s").agg(pl.len())
del frame
print(duck, rss_mb() - before)
"""

LIBRARY_DEFAULT = "dirty_decay_ms:10000"  # jemalloc's own: freed pages kept for 10 s


def _kept_mb(**conf: str) -> tuple[int, int]:
    """MiB that stayed after DuckDB's table and polars' frame were gone."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("MALLOC_CONF")}
    out = subprocess.run(
        [sys.executable, "-c", AFTER_A_BIG_QUERY],
        env={**env, **conf},
        capture_output=True,
        text=True,
        check=True,
    )
    duck, polars = (int(v) for v in out.stdout.split())
    return duck, polars


def test_duckdb_and_polars_give_freed_memory_back_at_once_unless_the_user_says() -> None:
    duck, polars = _kept_mb()
    # a user's own setting is kept: here the libraries' default, for comparison
    duck_default, polars_default = _kept_mb(
        DUCKDB_JE_MALLOC_CONF=LIBRARY_DEFAULT, _RJEM_MALLOC_CONF=LIBRARY_DEFAULT
    )
    # measured: 13-15 and 85-127 MiB stayed; with the libraries' default 382 and 576 MiB did
    assert duck * 3 < duck_default and polars * 3 < polars_default, (
        (duck, polars),
        (duck_default, polars_default),
    )
