"""The state store: all of lowtide's SQL, behind one facade.

`Store` is assembled from one part per aggregate, each in its own module:

- `runs`: jobs, runs, the run state machine and the lease;
- `manifest`: sources, units, requests and batches (the write-ahead manifest);
- `results`: results, re-asks, prices and the per-run tables derived from them;
- `publish`: the analysts' file, rebuilt and swapped in atomically;
- `reports`: read models for status, summaries, reports and exports;
- `history`: a job's runs over time, for the charts of `lowtide report`;
- `unchanged`: the night nothing changed, recorded from the run the view already shows;
- `carry`: the night a few rows changed: the unchanged rows' units copied from that run;
- `cursor`: where an incremental job's next run starts reading (`[input] cursor_column`);
- `route`: a `[route]`'s steps, the switch between engines and what it cost (`paid_twice`);
- `chunk_cuts`: where long texts were cut, so a night tokenizes only texts it has not seen;
- `provider_items`: what batches left at their provider (files, Anthropic batches), and
  whether lowtide deleted it.

`prefect_db` reads Prefect's own SQLite database, for the migrated copy a new Prefect home
starts from (`lowtide.prefect_template`).

`Store` itself lives in `facade` and is loaded on first use; `in_flight` answers "is anything in
flight?" without polars (the scheduled `collect` that finds nothing). Connections and quoting are
private (`_db`, `_sql`); `compute` reads an input table with SQL and touches no state.
Nothing outside this package writes SQL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lowtide.store.facade import EXPORT_FORMATS, JobHistory, Store, now

__all__ = ["EXPORT_FORMATS", "JobHistory", "Store", "now"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from lowtide.store import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'lowtide.store' has no attribute {name!r}")
