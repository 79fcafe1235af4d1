"""The `Store` facade: one class assembled from every part of the state store (see the package
docstring). Imported lazily by `lowtide.store`, so a command that only needs `in_flight` does
not load polars."""

from __future__ import annotations

from lowtide.store.carry import CarryStore
from lowtide.store.chunk_cuts import ChunkCutsStore
from lowtide.store.cursor import CursorStore
from lowtide.store.history import HistoryStore, JobHistory
from lowtide.store.limits import LimitsStore
from lowtide.store.manifest import ManifestStore
from lowtide.store.provider_items import ProviderItemsStore
from lowtide.store.reports import EXPORT_FORMATS, ReportsStore
from lowtide.store.results import ResultsStore
from lowtide.store.route import RouteStore
from lowtide.store.runs import now
from lowtide.store.sources import SourcesStore


class Store(
    LimitsStore,
    ReportsStore,
    ManifestStore,
    ResultsStore,
    HistoryStore,
    CarryStore,
    CursorStore,
    RouteStore,
    ChunkCutsStore,
    SourcesStore,
    ProviderItemsStore,
):
    """The state file. Each public method is one short transaction, named for its purpose."""


__all__ = ["EXPORT_FORMATS", "JobHistory", "Store", "now"]
