"""What a run shows in the Prefect UI: a progress artifact while it waits, and when it ends a
table of its numbers and cost plus a markdown report that ends with the job's history as charts
(`lowtide.charts`, embedded as SVG data-URI images). Artifacts are written only inside a flow
run; elsewhere (unit tests calling a task's .fn) these functions do nothing.

The flow run's Artifacts tab lists artifacts as cards that show only their key and description,
so each description carries the headline (rows, outcomes, cost) and the table holds the detail.
Keys are per job (`<job>-run`, `<job>-report`, `<job>-progress`), so the Artifacts page also
keeps each job's history run after run.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

from lowtide import progress
from lowtide.store.published import first_query

if TYPE_CHECKING:
    from lowtide.charts import Chart


def _key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:120]


def _in_flow() -> bool:
    """Whether a Prefect flow run is going on: never where Prefect was not even imported (a
    flow run in-process, `lowtide.orchestration.without_prefect`)."""
    if "prefect.context" not in sys.modules:
        return False
    from prefect.context import FlowRunContext

    return FlowRunContext.get() is not None


def start_progress(job: str) -> str | None:
    """A progress artifact for the run's batches; returns its id for updates."""
    if not _in_flow():
        return None
    from prefect.artifacts import create_progress_artifact

    artifact_id = create_progress_artifact(
        progress=0.0, key=_key(job, "progress"), description=f"{job}: waiting for requests"
    )
    return str(artifact_id)


@contextmanager
def progress_artifact(job: str) -> Iterator[str | None]:
    """A progress artifact that follows the batches' progress reports while the block runs;
    yields its id (None outside a flow run)."""
    artifact_id = start_progress(job)

    def listen(stage: str, done: int, total: int, note: str) -> None:
        if stage == "batches":
            update_progress(artifact_id, done, total)

    progress.add_listener(listen)
    try:
        yield artifact_id
    finally:
        progress.remove_listener(listen)


def update_progress(artifact_id: str | None, done: int, total: int) -> None:
    """Move the progress artifact to done/total requests finished (a no-op outside a run)."""
    if artifact_id is None or total <= 0:
        return
    from prefect.artifacts import update_progress_artifact

    update_progress_artifact(
        artifact_id=UUID(artifact_id),
        progress=min(100.0, 100.0 * done / total),
        description="all requests finished"
        if done >= total
        else f"{_int(done)} of {_int(total)} requests finished",
    )


def _usd(value: Any) -> str:
    return "" if value is None else f"${float(value):,.4f}"


def _int(value: Any) -> str:
    return "" if value is None else f"{int(value):,}"


def _pct(value: Any) -> str:
    return "" if value is None else f"{float(value):.2%}"


def headline(summary: dict[str, Any]) -> str:
    """Rows, cost and failures in one short line: the Artifacts tab cuts card descriptions at
    about 45 characters, so the numbers an operator checks come first.

    >>> headline({"job": "j", "rows": 1200, "succeeded": 1190, "failed": 10, "cost_usd": 0.5})
    '1,200 rows · cost $0.5000 · 10 failed'
    """
    return (
        f"{_int(summary.get('rows') or 0)} rows · cost {_usd(summary.get('cost_usd') or 0.0)} · "
        f"{_int(summary.get('failed') or 0)} failed"
    )


# The run's key numbers, in the order they are shown: (metric name, label, format).
_KEY_METRICS = (
    ("completions_per_minute", "completions per minute", lambda v: f"{v:,.1f}"),
    ("failure_rate", "failure rate", _pct),
    ("retry_rate", "retry rate", _pct),
    ("mean_context_tokens", "mean context tokens", lambda v: f"{v:,.0f}"),
    ("slowest_batch_s", "slowest batch (s)", lambda v: f"{v:,.1f}"),
    ("max_output_tokens", "longest answer (tokens)", lambda v: f"{v:,.0f}"),
)


def run_table(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The run's numbers as rows of (metric, value), the shape the UI's table shows best.

    Row count and cost come first: they are what an operator checks every morning."""
    m = summary.get("metrics") or {}
    naive = summary.get("naive_cost_usd") or 0.0
    cost = summary.get("cost_usd") or 0.0
    rows: list[tuple[str, Any]] = [
        ("rows", _int(summary.get("rows"))),
        ("cost", _usd(cost)),
        ("succeeded", _int(summary.get("succeeded"))),
        ("failed", _int(summary.get("failed"))),
        ("status", summary.get("status")),
        ("run", summary.get("run_id")),
        ("backend / model", f"{summary.get('backend')} / {summary.get('model')}"),
        ("units", _int(summary.get("units"))),
        ("unique requests", _int(summary.get("unique_requests"))),
        ("cache hits", _int(summary.get("cache_hits"))),
        ("requests sent", _int(summary.get("requests_sent"))),
        ("input tokens", _int(summary.get("input_tokens"))),
        ("cached input tokens", _int(summary.get("cached_tokens"))),
        ("output tokens", _int(summary.get("output_tokens"))),
        ("estimate", _usd(summary.get("estimate_usd"))),
        ("billed tokens at realtime price", _usd(summary.get("realtime_cost_usd"))),
        ("realtime, no dedupe, no cache", _usd(naive)),
        (
            "savings",
            _usd(naive - cost) + (f" ({(naive - cost) / naive:.0%})" if naive else ""),
        ),
    ]
    for name, label, fmt in _KEY_METRICS:
        if m.get(name) is not None:
            rows.append((label, fmt(m[name])))
    if summary.get("eval_accuracy") is not None:
        rows.append(("eval accuracy", f"{summary['eval_accuracy']:.1%}"))
    return [{"metric": k, "value": "" if v is None else str(v)} for k, v in rows]


def _link(path: str) -> str:
    p = Path(path).expanduser().resolve()
    return f"[`{path}`]({p.as_uri()})"


def run_report_markdown(summary: dict[str, Any], charts: Sequence[Chart] = ()) -> str:
    """The run report: outcome, QA sample, eval scores (against the previous published run when
    the summary carries `eval_previous_by_field`), failures by reason, the job's history as
    `charts` (markdown images with SVG data URIs, which both Prefect UIs render) and links to
    the files.

    Optional summary keys used when present: `qa_samples` (rows sampled for review),
    `exports` (label → file path), `eval_previous_by_field`, `gate_note` (why a gate held
    the run), `error` (why a failed run failed)."""
    job = str(summary.get("job", ""))
    lines = [f"# {job} — run {summary.get('run_id')}", ""]
    lines.append(
        f"**{_int(summary.get('succeeded') or 0)}** of **{_int(summary.get('rows') or 0)}** rows "
        f"succeeded, **{_int(summary.get('failed') or 0)}** failed; cost "
        f"**{_usd(summary.get('cost_usd') or 0.0)}** "
        f"(estimate {_usd(summary.get('estimate_usd')) or 'n/a'}, "
        f"realtime, no dedupe, no cache {_usd(summary.get('naive_cost_usd')) or 'n/a'})."
    )
    if summary.get("qa_samples") is not None:
        lines += [
            "",
            "## QA sample",
            "",
            f"{_int(summary['qa_samples'])} rows sampled for human review "
            f"(table `qa_samples`, run `{summary.get('run_id')}`).",
        ]
    evals = {k: v for k, v in (summary.get("eval_by_field") or {}).items() if v is not None}
    if evals:
        previous = summary.get("eval_previous_by_field") or {}
        lines += ["", "## Eval set", ""]
        if previous:
            lines += ["| field | accuracy | previous | change |", "|---|---|---|---|"]
            for k, v in evals.items():
                before = previous.get(k)
                change = "" if before is None else f"{(v - before) * 100:+.1f} pt"
                prev = "" if before is None else f"{before:.1%}"
                lines.append(f"| {k} | {v:.1%} | {prev} | {change} |")
        else:
            lines += ["| field | accuracy |", "|---|---|"]
            lines += [f"| {k} | {v:.1%} |" for k, v in evals.items()]
    if summary.get("status") == "failed":
        lines += ["", f"**Failed:** {summary.get('error')}. The job view keeps the last one."]
    elif summary.get("gate_note"):
        lines += [
            "",
            f"**Held:** {summary['gate_note']}. The job view keeps the last "
            f"published run; `lowtide publish {summary.get('run_id')}` releases this one.",
        ]
    failures = summary.get("failures_by_reason") or {}
    if failures:
        lines += ["", "## Failures by reason", "", "| reason | rows |", "|---|---|"]
        lines += [f"| {k} | {_int(v)} |" for k, v in failures.items()]
    if charts:
        lines += ["", "## History", ""]
        for c in charts:
            lines += [f"![{c.title}]({c.data_uri()})", ""]
        lines += [f"The same charts offline: `lowtide report {job} --out report.html`."]
    files = {"published database": summary.get("db"), **(summary.get("exports") or {})}
    files = {k: v for k, v in files.items() if v}
    if files:
        lines += ["", "## Files", ""]
        lines += [f"- {label}: {_link(str(path))}" for label, path in files.items()]
    view = job.replace("-", "_")
    lines += ["", f'First query: `lowtide sql "{first_query(view, ["*"], 10)}"`.']
    return "\n".join(lines)


def publish_run_report(summary: dict[str, Any]) -> None:
    """The table and markdown artifacts for a finished run."""
    if not _in_flow():
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    job = str(summary.get("job", "job"))
    create_table_artifact(
        table=run_table(summary),
        key=_key(job, "run"),
        description=headline(summary),
    )
    create_markdown_artifact(
        markdown=run_report_markdown(summary, history_charts_of(summary)),
        key=_key(job, "report"),
        description="QA sample, eval set, failures, history charts, files",
    )


def history_charts_of(summary: dict[str, Any]) -> list[Chart]:
    """The charts of the job's last finished runs, read from the state file the summary names
    (`state`); none when it names none, or the job has none yet (its first night failed)."""
    if not summary.get("state") or not summary.get("job"):
        return []
    from lowtide.charts import history_charts
    from lowtide.errors import RunNotFoundError
    from lowtide.store import Store

    try:
        history = Store(summary["state"]).job_history(str(summary["job"]))
    except RunNotFoundError:
        return []
    return history_charts(history)


def publish_markdown(job: str, name: str, markdown: str, description: str) -> None:
    """A markdown artifact keyed <job>-<name>, inside a flow run only."""
    if not _in_flow():
        return
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=markdown, key=_key(job, name), description=description)
