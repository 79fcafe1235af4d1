"""What a run shows in the Prefect UI: a progress artifact while it waits, and when it ends a
table of its numbers and cost plus a markdown report. Artifacts are written only inside a flow
run; elsewhere (unit tests calling a task's .fn) these functions do nothing.
"""

from __future__ import annotations

import re
from typing import Any

from prefect.context import FlowRunContext


def _key(*parts: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:120]


def _in_flow() -> bool:
    return FlowRunContext.get() is not None


def start_progress(job: str) -> str | None:
    """A progress artifact for the run's batches; returns its id for updates."""
    if not _in_flow():
        return None
    from prefect.artifacts import create_progress_artifact

    artifact_id = create_progress_artifact(
        progress=0.0, key=_key(job, "progress"), description=f"{job}: requests finished"
    )
    return str(artifact_id)


def update_progress(artifact_id: str | None, done: int, total: int) -> None:
    if artifact_id is None or total <= 0:
        return
    from prefect.artifacts import update_progress_artifact

    update_progress_artifact(artifact_id=artifact_id, progress=min(100.0, 100.0 * done / total))


def _usd(value: Any) -> str:
    return "" if value is None else f"${float(value):.4f}"


def run_table(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The run's numbers as rows of (metric, value), the shape the UI's table shows best."""
    m = summary.get("metrics") or {}
    realtime = summary.get("realtime_cost_usd") or 0.0
    cost = summary.get("cost_usd") or 0.0
    rows = [
        ("run", summary.get("run_id")),
        ("status", summary.get("status")),
        ("backend / model", f"{summary.get('backend')} / {summary.get('model')}"),
        ("rows", summary.get("rows")),
        ("succeeded", summary.get("succeeded")),
        ("failed", summary.get("failed")),
        ("units", summary.get("units")),
        ("unique requests", summary.get("unique_requests")),
        ("cache hits", summary.get("cache_hits")),
        ("requests sent", summary.get("requests_sent")),
        ("input tokens", summary.get("input_tokens")),
        ("cached input tokens", summary.get("cached_tokens")),
        ("output tokens", summary.get("output_tokens")),
        ("cost", _usd(cost)),
        ("estimate", _usd(summary.get("estimate_usd"))),
        ("realtime counterfactual", _usd(realtime)),
        ("savings", _usd(realtime - cost)),
        ("completions per minute", f"{m.get('completions_per_minute', 0):.1f}"),
        ("failure rate", f"{m.get('failure_rate', 0):.2%}"),
        ("retry rate", f"{m.get('retry_rate', 0):.2%}"),
        ("mean context tokens", f"{m.get('mean_context_tokens', 0) or 0:.0f}"),
        (
            "eval accuracy",
            "" if summary.get("eval_accuracy") is None else f"{summary['eval_accuracy']:.1%}",
        ),
    ]
    return [{"metric": k, "value": "" if v is None else str(v)} for k, v in rows]


def run_report_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# {summary.get('job')} — run {summary.get('run_id')}", ""]
    lines.append(
        f"**{summary.get('succeeded')}** of **{summary.get('rows')}** rows succeeded, "
        f"**{summary.get('failed')}** failed; cost {_usd(summary.get('cost_usd'))}."
    )
    evals = summary.get("eval_by_field") or {}
    if evals:
        lines += ["", "## Eval set", "", "| field | accuracy |", "|---|---|"]
        lines += [f"| {k} | {v:.1%} |" for k, v in evals.items() if v is not None]
    failures = summary.get("failures_by_reason") or {}
    if failures:
        lines += ["", "## Failures by reason", "", "| reason | rows |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in failures.items()]
    lines += [
        "",
        f"Published to `{summary.get('db')}`: `SELECT * FROM {str(summary.get('job', '')).replace('-', '_')}`.",
    ]
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
        description=f"{job}: the run's numbers and cost",
    )
    create_markdown_artifact(
        markdown=run_report_markdown(summary),
        key=_key(job, "report"),
        description=f"{job}: run report",
    )
