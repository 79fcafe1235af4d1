"""The mark of an incremental job (`[input] cursor_column`): where its next run starts reading.

A run of such a job records, at load, the column it read past (`runs.cursor_column`), the mark it
read past (`cursor_from`, NULL when it read every row) and the mark it leaves for the next run
(`cursor_high`: the largest cursor value it read, or `cursor_from` when it read nothing). Marks
are JSON, `{"type": ..., "value": ...}`, written and read by `tasks/load.py`.

A mark counts only once its run is completed and published, so a run that crashed, failed, was
held by the eval gate or was cancelled never makes the next run skip rows: the next run reads
from the last mark whose rows the job view shows.
"""

from __future__ import annotations

from lowtide.store.runs import RunsStore
from lowtide.vocabulary import RunStatus


class CursorStore(RunsStore):
    def cursor_mark(
        self, job: str, *, column: str, backend: str, job_fingerprint: str
    ) -> str | None:
        """The mark the next run of `job` reads past: the `cursor_high` of the job's newest
        published run (runs recorded as unchanged aside), when that run completed and read past
        the same column with the same backend and prompt fingerprint. None, meaning read every
        row, for a first run, after a cancelled newest run, or after a change of cursor column,
        backend or question (the view then starts over from that full read)."""
        found = self._query(
            "SELECT status, backend, job_fingerprint, cursor_column, cursor_high FROM runs "
            "WHERE job = ? AND published_at IS NOT NULL AND unchanged_from IS NULL "
            "ORDER BY started_at DESC LIMIT 1",
            [job],
        ).to_dicts()
        if not found:
            return None
        newest = found[0]
        same = (
            newest["status"] == RunStatus.COMPLETED.value
            and newest["cursor_column"] == column
            and newest["backend"] == backend
            and newest["job_fingerprint"] == job_fingerprint
        )
        return newest["cursor_high"] if same else None

    def record_cursor(
        self, run_id: str, *, column: str, read_past: str | None, high: str | None
    ) -> None:
        """What the run read: past `read_past` (None: every row) up to `high`, its mark for the
        next run once it is completed and published."""
        self._update(
            "runs", "run_id", run_id, cursor_column=column, cursor_from=read_past, cursor_high=high
        )
