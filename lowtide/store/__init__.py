"""The state store: all of lowtide's SQL, behind one facade.

`Store` is assembled from one part per aggregate, each in its own module:

- `runs`: jobs, runs, the run state machine and the lease;
- `manifest`: sources, units, requests and batches (the write-ahead manifest);
- `results`: results, re-asks, prices and the per-run tables derived from them;
- `publish`: the analysts' file, rebuilt and swapped in atomically;
- `reports`: read models for status, summaries, reports and exports;
- `history`: a job's runs over time, for the charts of `lowtide report`;
- `unchanged`: the night nothing changed, recorded from the run the view already shows;
- `cursor`: where an incremental job's next run starts reading (`[input] cursor_column`);
- `route`: a `[route]`'s steps, the switch between engines and what it cost (`paid_twice`);
- `chunk_cuts`: where long texts were cut, so a night tokenizes only texts it has not seen.

Connections and quoting are private (`_db`, `_sql`); `compute` is SQL used as a calculator
(hashes, reading an input table) that touches no state. Nothing outside this package writes SQL.
"""

from __future__ import annotations

from lowtide.store.chunk_cuts import ChunkCutsStore
from lowtide.store.cursor import CursorStore
from lowtide.store.history import HistoryStore, JobHistory
from lowtide.store.manifest import ManifestStore
from lowtide.store.reports import EXPORT_FORMATS, ReportsStore
from lowtide.store.results import ResultsStore
from lowtide.store.route import RouteStore
from lowtide.store.runs import now
from lowtide.store.unchanged import UnchangedStore


class Store(
    ReportsStore,
    ManifestStore,
    ResultsStore,
    HistoryStore,
    UnchangedStore,
    CursorStore,
    RouteStore,
    ChunkCutsStore,
):
    """The state file. Each public method is one short transaction, named for its purpose."""


__all__ = ["EXPORT_FORMATS", "JobHistory", "Store", "now"]
