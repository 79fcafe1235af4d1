"""Units carried over, for input rows that did not change since the run the job's view shows.

A night that changed 1% of a million rows would otherwise chunk, render and hash every row to
learn that 99% of its units are cache hits. A row whose content key (`lowtide_row_key`, over
its id and every stored column) is the one the shown run read, under the same job spec, backend
and model, has exactly the units that run made: same cuts, same rendered message, same
custom_id. When each of them has an answer, the new run copies them in SQL as cache hits, and
only new and changed rows go through chunk → dedupe. A row with a unit still unanswered there
(a failure to ask again) goes the long way, so it is asked again as before.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from lowtide.store.sources import MEMBERS
from lowtide.store.unchanged import UnchangedStore
from lowtide.vocabulary import ANSWERED, RunStatus


class CarryStore(UnchangedStore):
    def carry_source(
        self,
        job: str,
        *,
        backend: str,
        model: str,
        job_fingerprint: str,
        spec_digest: str,
        units_recipe: str,
    ) -> str | None:
        """The run whose units an unchanged row can take: the one whose rows the job's view
        shows (through an unchanged night, the run it points at), when it was made by the same
        job spec on the same backend and model, from columns of the same types with the same
        cutting and custom_id recipes (`units_recipe`), and was not a route's step (whose units
        may hold another engine's answers); else None."""
        shown = self.shown_run(job)
        if shown is None or shown["status"] != RunStatus.COMPLETED.value:
            return None
        lender = shown if shown["rows_run"] == shown["run_id"] else self.get_run(shown["rows_run"])
        if lender is None or lender["route_step"] is not None:
            return None
        same: dict[str, Any] = {
            "backend": backend,
            "model": model,
            "job_fingerprint": job_fingerprint,
            "spec_digest": spec_digest,
            "units_recipe": units_recipe,
        }
        if any(lender[k] != v for k, v in same.items()):
            return None
        return str(lender["run_id"])

    def unchanged_answered_rows(self, view: str, run_id: str, from_run: str) -> pl.DataFrame:
        """`source_id` of the run's input rows that `from_run` read with the same content and
        whose every row unit there has an answer: their units can be carried over as they are
        (`carry_source` made sure `from_run` keyed them under the current custom_id recipe)."""
        return self._query(
            f"""
            WITH answered AS (
                SELECT u.source_id
                FROM units u LEFT JOIN results r USING (custom_id)
                WHERE u.run_id = $from AND u.kind = 'row'
                GROUP BY u.source_id
                HAVING bool_and(coalesce(list_contains($answered, r.outcome), false))
            )
            SELECT m.source_id FROM {MEMBERS} m
            JOIN {MEMBERS} p ON p.view = m.view AND p.run_id = $from
                AND p.source_id = m.source_id AND p.lowtide_row_key = m.lowtide_row_key
            SEMI JOIN answered a ON a.source_id = m.source_id
            WHERE m.view = $view AND m.run_id = $run
            """,
            {
                "from": from_run,
                "answered": list(ANSWERED),
                "view": view,
                "run": run_id,
            },
        )
