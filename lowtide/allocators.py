"""How long DuckDB's and polars' allocators keep freed memory before giving it back.

Each links its own jemalloc, which by default keeps freed pages up to 10 s to reuse them. A run
frees big slices stage after stage, so both kept hundreds of MiB that were no longer in use
and the next stage's allocations came on top of them: at 100,000 rows the process held 500-850
MB between stages and 450-550 with the pages handed back at once; at 1M rows the tops of
reconcile, finalize and publish fell 2.24 -> 1.85, 2.1 -> 1.39 and 1.87 -> 1.64 GB. Each
library reads its setting once, when it starts, so they are set on importing lowtide, before
either loads (a process that imports polars first keeps polars' own), and processes lowtide
starts inherit them; a value the user set is kept.

But a page handed back is a page the kernel must give again, zeroed, at the next allocation:
on a virtual machine each such fault costs microseconds. With both handing back at once, a 1M
first night touched 15.2 million fresh pages and spent 53.9 of its 157.9 s of CPU in the
kernel (2026-12-06). polars allocates and frees every slice of every stage; keeping its freed
pages for 3 s lets the next slice reuse them: 8.2 million faults, 38.1 s in the kernel, 130.7 s
of CPU, at a peak of 1.74 GB against 1.54 (10 s: 126.0 s but 1.85 GB, too close to the 2 GB
target). Later stages got faster, and a chunk slice (50,000 rows) now takes ~2.5 s, so pages
kept 3 s were mostly gone before the next slice could reuse them: chunk and key 400,000 rows
touched 517,000 fresh pages at 3 s, 374,000 at 6 s, 254,000 at 10 s (2026-12-06, AMD EPYC).
They are kept 6 s: the run's peak (in load and submit now that finalize counts its failures in
DuckDB) was 1.85 GB with 10 s; 6 s keeps more room below 2 GB (its 1M bench: 1.70 GB, 3.8
million faults against 5.0 million at 3 s the same day). Measured again once the submit's lines
pass held ~350 MB less (8a6c7b2; 2026-12-07, two alternating pairs of 1M first nights): 10 s took
89.2 and 84.1 s of CPU against 84.2 and 93.1 s at 6 s, and peaked at 1.72-1.77 GB in load
against 1.46-1.51 GB: no gain to pay that room for.

DuckDB keeps its freed pages 1 s, and a thread of its allocator gives them back after that
whether or not DuckDB works meanwhile (so a stage that frees a big table and then waits does
not hold it). Two same-hour pairs of 1M first nights, pages back at once against kept 1 s:
103.3 -> 95.1 s of CPU with 6.71 -> 4.72 million page faults, and 98.0 -> 90.9 s (2026-12-06);
the peak moved from 1.70-1.76 to 1.72-2.10 GB over five runs, so the prepared lines' pass, the
stage where it was reached, let go of ~200 MB before its lines are built.

Huge pages do not help here (2026-12-07, AMD EPYC, transparent huge pages on madvise). DuckDB's
jemalloc was built without them ("No THP support"). Polars' takes `thp:always`, and then six
passes of folding the case and whitespace of 300,000 real texts (as keying does) touched
3,000-4,000 fresh pages instead of ~250,000, but took 10.9-11.2 s of CPU against 9.3-9.6 s
(1.2-1.4 s in the kernel against 0.6), at ~60 MB more peak: three alternating pairs. Zeroing
whole 2 MB pages costs more than the faults they save.
"""

from __future__ import annotations

import os

DUCKDB_FREED_PAGES = "dirty_decay_ms:1000,muzzy_decay_ms:0,background_thread:true"
REUSE_FREED_PAGES = "dirty_decay_ms:6000,muzzy_decay_ms:0"

for variable, setting in (
    ("DUCKDB_JE_MALLOC_CONF", DUCKDB_FREED_PAGES),  # DuckDB's
    ("_RJEM_MALLOC_CONF", REUSE_FREED_PAGES),  # polars'
):
    os.environ.setdefault(variable, setting)
