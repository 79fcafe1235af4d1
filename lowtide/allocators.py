"""How DuckDB's and polars' allocators give memory back: at once.

Each links its own jemalloc, which keeps freed pages a while (up to seconds) to reuse them. A
run frees big slices stage after stage, so both kept hundreds of MiB that were no longer in use
and the next stage's allocations came on top of them: at 100,000 rows the process held 500-850
MB between stages and 450-550 with the pages handed back at once; at 1M rows the tops of
reconcile, finalize and publish fell 2.24 -> 1.85, 2.1 -> 1.39 and 1.87 -> 1.64 GB. Each
library reads its setting once, when it starts, so they are set on importing lowtide, before
either loads (a process that imports polars first keeps polars' own), and processes lowtide
starts inherit them; a value the user set is kept.

Handing pages back at every free costs system time (a 100,000-row first night: 23.5 s of CPU,
7.4 of it in the kernel, against 19.9 s with jemalloc's own 10 s). jemalloc's background
thread with a 1 s decay (`background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0`) took
that night to 20.8-22.4 s, but at 1M rows the first night peaked at 2.23 GB (reconcile) against
1.91 with pages handed back at once: the 2 GB target wins, so they still go back at once.
"""

from __future__ import annotations

import os

RETURN_FREED_PAGES = "dirty_decay_ms:0,muzzy_decay_ms:0"

for variable in ("DUCKDB_JE_MALLOC_CONF", "_RJEM_MALLOC_CONF"):  # DuckDB's, then polars'
    os.environ.setdefault(variable, RETURN_FREED_PAGES)
