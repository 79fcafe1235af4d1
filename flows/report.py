"""qa-report: a morning report per job for the people who review and sign off.

For each job, the latest finished run: rows, failures by reason and cost; its QA sample and,
once a reviewer's verdicts were imported, the reviewed accuracy with its 95% interval; and the
eval scores of the last runs, so a drift shows as a trend. Written as a markdown artifact.
"""

from __future__ import annotations

from typing import Any

from lowtide import artifacts
from lowtide.orchestration import flow
from lowtide.settings import Settings
from lowtide.store import Store

TREND_RUNS = 7


def report_markdown(store: Store, job: str, run: dict[str, Any], s: dict[str, Any]) -> str:
    m = s.get("metrics") or {}
    lines = [
        f"# {job}: QA and eval report",
        "",
        f"Latest finished run: `{run['run_id']}` "
        f"({run['status']}), {s.get('succeeded')} of {s.get('rows')} rows succeeded, "
        f"cost ${s.get('cost_usd') or 0:.4f}.",
    ]
    if run.get("gate_note"):
        lines += [
            "",
            f"**Held:** {run['gate_note']}. `lowtide publish {run['run_id']}` releases it.",
        ]
    lines += ["", "## Human review", ""]
    if "qa_reviewed_accuracy" in m:
        lines.append(
            f"{m['qa_reviewed']:.0f} of {s.get('qa_samples')} sampled rows reviewed: accuracy "
            f"{m['qa_reviewed_accuracy']:.1%} (95% CI {m['qa_accuracy_ci_low']:.1%} to "
            f"{m['qa_accuracy_ci_high']:.1%})."
        )
    else:
        lines.append(
            f"{s.get('qa_samples')} rows sampled, not reviewed yet: "
            f"`lowtide qa export {run['run_id']} --out review.csv`, then `lowtide qa import review.csv`."
        )
    trend = store.eval_trend(job, TREND_RUNS)
    if trend.height:
        fields = sorted(set(trend["field"]))
        lines += [
            "",
            "## Eval set, last runs",
            "",
            "| run | " + " | ".join(fields) + " |",
            "|---|" + "---|" * len(fields),
        ]
        for run_id in dict.fromkeys(trend["run_id"]):
            part = trend.filter(trend["run_id"] == run_id)
            acc = dict(zip(part["field"], part["accuracy"], strict=True))
            lines.append(
                f"| {run_id} | "
                + " | ".join("" if acc.get(f) is None else f"{acc[f]:.1%}" for f in fields)
                + " |"
            )
    if s.get("failures_by_reason"):
        lines += ["", "## Failures by reason", "", "| reason | rows |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in s["failures_by_reason"].items()]
    return "\n".join(lines)


@flow(name="qa-report", flow_run_name="qa-report", log_prints=False)
def qa_report(state: str | None = None, job: str | None = None) -> list[str]:
    """Write the report of every job (or one); returns the reports' markdown."""
    settings = Settings().with_overrides(state=state)
    if not settings.state.is_file():
        return []
    store = Store(settings.state, settings.lock_timeout_s)
    reports = []
    for run in store.latest_finished_runs(job):
        text = report_markdown(store, run["job"], run, store.run_summary(run["run_id"]))
        artifacts.publish_markdown(
            run["job"], "qa-report", text, f"{run['job']}: QA and eval report"
        )
        reports.append(text)
    return reports
