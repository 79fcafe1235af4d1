"""Which input rows of a run keep the units of the run the job's view shows (`store.carry`).

Decided after load has stored the run's rows (and their content keys), before chunking: those
rows skip chunk and dedupe, and dedupe copies their units, all answered, as cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from lowtide.context import RunContext
from lowtide.input_identity import spec_digest


@dataclass(frozen=True)
class Carried:
    from_run: str
    source_ids: pl.DataFrame
    """One column, `source_id`: the rows whose units are copied from `from_run`."""


def unchanged_rows(ctx: RunContext, run_id: str, units_recipe: str) -> Carried | None:
    """The rows of the run whose units can be copied, and from which run; None when no earlier
    run fits (a first night; a changed job spec, backend, model or `units_recipe`) or the run is
    a route's step (whose units may take another engine's answers, `carry_route_answers`)."""
    store, job = ctx.store, ctx.job
    if store.require_run(run_id)["route_step"] is not None:
        return None
    source = store.carry_source(
        job.name,
        backend=ctx.backend,
        model=job.model.name,
        job_fingerprint=job.prompt_fingerprint(),
        spec_digest=spec_digest(job),
        units_recipe=units_recipe,
    )
    if source is None:
        return None
    ids = store.unchanged_answered_rows(job.view_name, run_id, source)
    return Carried(source, ids) if ids.height else None
