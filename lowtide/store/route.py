"""A route's steps (`[route]`): which run is the current step, the switch, and what switching
cost (`paid_twice`).

Every step is a run with `route_id` (the first step's run id), `route_step` and `step_ends_at`
(NULL for the last step). A step whose time ran out gets `switched_at` and goes to `cancelling`:
its in-flight batches still end (and are collected) like those of a cancelled run, and it ends
`cancelled`, never published. The step after it shows every row of the route.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from lowtide.store.runs import RunsStore, _insert_run, now
from lowtide.vocabulary import ANSWERED, RESUMABLE_RUN, RunStatus, sql_list

_ROUTE_COLUMNS = (
    "run_id, route_id, route_step, step_ends_at, switched_at, started_at, status, backend"
)

# billed: the provider answered (a parse failure is billed too)
_BILLED = ("ok", "repaired", "reasked", "parse_failed")


class RouteStore(RunsStore):
    def route_position(
        self, job: str, fingerprint: str, input_fingerprint: str
    ) -> dict[str, Any] | None:
        """The newest step of the newest route whose first step had this job content (its
        `fingerprint`) and input, when the route is not over: a
        step to resume (`switched_at` NULL, unfinished or completed but unpublished) or one
        that was switched away from (the next step is to be opened), or a later step that
        failed before sending (to be opened again). None: start a route."""
        rows = self._query(
            f"SELECT {_ROUTE_COLUMNS}, published_at, "
            "(SELECT min(started_at) FROM runs f WHERE f.run_id = r.route_id) AS route_started "
            "FROM runs r WHERE route_id IN (SELECT run_id FROM runs WHERE job = ? "
            "AND job_fingerprint = ? AND input_fingerprint IS NOT DISTINCT FROM ? "
            "AND route_step = 0) ORDER BY started_at DESC, route_step DESC LIMIT 1",
            [job, fingerprint, input_fingerprint],
        ).to_dicts()
        if not rows:
            return None
        step = rows[0]
        status = RunStatus(step["status"])
        if step["switched_at"] is not None:
            return step
        unpublished = status is RunStatus.COMPLETED and step["published_at"] is None
        if status is RunStatus.FAILED and step["route_step"] > 0:
            return step  # refused before sending, or every row failed: opened again
        return step if status in RESUMABLE_RUN or unpublished else None

    def open_route_step(
        self,
        run: Mapping[str, Any],
        *,
        route_id: str,
        step: int,
        step_ends_at: datetime | None,
    ) -> str:
        """Step `step` of route `route_id`: the run another process opened for it meanwhile
        (for step 0: an unfinished first step of the same job content and input), else a new
        run in `running`. One transaction, so two starts never open one step twice."""
        with self._transaction() as con:
            if step == 0:
                found = con.execute(
                    "SELECT run_id FROM runs WHERE job = ? AND job_fingerprint = ? "
                    "AND input_fingerprint IS NOT DISTINCT FROM ? AND route_step = 0 "
                    "AND switched_at IS NULL AND list_contains(?, status) "
                    "ORDER BY started_at DESC LIMIT 1",
                    [
                        run["job"],
                        run["job_fingerprint"],
                        run["input_fingerprint"],
                        sql_list(RESUMABLE_RUN),
                    ],
                ).fetchall()
            else:
                found = con.execute(
                    "SELECT run_id FROM runs WHERE route_id = ? AND route_step = ? "
                    "AND status <> ? ORDER BY started_at DESC LIMIT 1",
                    [route_id, step, RunStatus.FAILED.value],
                ).fetchall()
            if found:
                return str(found[0][0])
            _insert_run(con, run)
            con.execute(
                "UPDATE runs SET route_id = ?, route_step = ?, step_ends_at = ? WHERE run_id = ?",
                [route_id if step else run["run_id"], step, step_ends_at, run["run_id"]],
            )
        return str(run["run_id"])

    def skip_step(self, run_id: str) -> None:
        """A step whose time was up before it sent anything ends `cancelled` at once."""
        with self._transaction() as con:
            con.execute(
                "UPDATE runs SET status = ?, finished_at = ?, "
                "switched_at = coalesce(switched_at, ?), "
                "error = 'its time was up before anything was sent' WHERE run_id = ?",
                [RunStatus.CANCELLED.value, now(), now(), run_id],
            )

    def has_later_step(self, route_id: str, step: int) -> bool:
        """Whether a step after `step` was opened (and did not fail before sending)."""
        return bool(
            self._scalar(
                "SELECT count(*) FROM runs WHERE route_id = ? AND route_step > ? AND status <> ?",
                [route_id, step, RunStatus.FAILED.value],
            )
        )

    def mark_switched(self, run_id: str) -> None:
        """The step's time is up: → cancelling (nothing new starts on its engine), stamped."""
        with self._transaction() as con:
            con.execute(
                "UPDATE runs SET switched_at = coalesce(switched_at, ?), "
                "status = CASE WHEN list_contains(?, status) THEN ? ELSE status END "
                "WHERE run_id = ?",
                [now(), sql_list(RESUMABLE_RUN), RunStatus.CANCELLING.value, run_id],
            )

    def route_steps(self, route_id: str) -> list[dict[str, Any]]:
        """The route's runs by step: engine, status, when it ended or was switched."""
        return self._query(
            f"SELECT {_ROUTE_COLUMNS}, model, finished_at, cost_usd FROM runs "
            "WHERE route_id = ? ORDER BY route_step, started_at",
            [route_id],
        ).to_dicts()

    def unfinished_earlier_steps(self, route_id: str, before_run: str) -> list[str]:
        """Switched steps of the route still waiting for their cancelled batches to end."""
        return [
            r["run_id"]
            for r in self.route_steps(route_id)
            if r["run_id"] != before_run and RunStatus(r["status"]).in_flight
        ]

    def paid_twice(self, route_id: str) -> dict[str, Any]:
        """Requests a switched step was billed for after its switch although a later step asked
        the same units again: {requests, cost_usd}, each request once. The later answer is the
        one shown; the earlier one stays in the cache."""
        row = self._query(
            """
            WITH steps AS (
                SELECT run_id, route_step, switched_at FROM runs WHERE route_id = ?
            ),
            own AS (
                SELECT u.source_id, u.chunk_index, s.route_step, r.custom_id,
                       coalesce(r.cost_usd, 0) AS cost,
                       s.switched_at IS NOT NULL AND r.received_at >= s.switched_at AS late
                FROM units u JOIN steps s USING (run_id)
                JOIN results r ON r.custom_id = u.custom_id AND r.run_id = u.run_id
                WHERE u.kind = 'row' AND list_contains(?, r.outcome)
            ),
            twice AS (
                SELECT DISTINCT e.custom_id, e.cost FROM own e
                WHERE e.late AND EXISTS (
                    SELECT 1 FROM own l WHERE l.source_id = e.source_id
                    AND l.chunk_index = e.chunk_index AND l.route_step > e.route_step)
            )
            SELECT count(*) AS requests, coalesce(sum(cost), 0) AS cost_usd FROM twice
            """,
            [route_id, sql_list(_BILLED)],
        ).to_dicts()[0]
        return {"requests": int(row["requests"]), "cost_usd": float(row["cost_usd"])}

    def record_paid_twice(self, run_id: str) -> None:
        """Refresh the route's `paid_twice_requests` / `paid_twice_usd` metrics on its newest
        step (the run its view shows), whenever one of its steps finishes."""
        route_id = self._scalar("SELECT route_id FROM runs WHERE run_id = ?", [run_id])
        if route_id is None:
            return
        paid = self.paid_twice(route_id)
        newest = self._scalar(
            "SELECT run_id FROM runs WHERE route_id = ? ORDER BY route_step DESC, started_at "
            "DESC LIMIT 1",
            [route_id],
        )
        with self._transaction() as con:
            for name, value in (
                ("paid_twice_requests", paid["requests"]),
                ("paid_twice_usd", paid["cost_usd"]),
            ):
                con.execute(
                    "INSERT OR REPLACE INTO metrics VALUES (?, ?, ?)", [newest, name, value]
                )

    def route_summary(self, run_id: str) -> dict[str, Any] | None:
        """For a run that is a route step: the route's steps, which step answered how many of
        the rows this run shows, and `paid_twice`. None for a run without a route."""
        route_id = self._scalar("SELECT route_id FROM runs WHERE run_id = ?", [run_id])
        if route_id is None:
            return None
        answered = dict(
            self._query(
                "SELECT ar.backend, count(*) FROM units u JOIN results r USING (custom_id) "
                "JOIN runs ar ON ar.run_id = r.run_id WHERE u.run_id = ? AND u.kind = 'row' "
                "AND list_contains(?, r.outcome) GROUP BY 1",
                [run_id, sql_list(ANSWERED)],
            ).iter_rows()
        )
        steps = [
            {
                "step": s["route_step"],
                "engine": s["backend"],
                "model": s["model"],
                "run_id": s["run_id"],
                "status": s["status"],
                "switched_at": s["switched_at"].isoformat() if s["switched_at"] else None,
                "cost_usd": s["cost_usd"],
            }
            for s in self.route_steps(route_id)
        ]
        return {
            "route_id": route_id,
            "steps": steps,
            "units_answered_by": {k: int(v) for k, v in answered.items()},
            "paid_twice": self.paid_twice(route_id),
        }
