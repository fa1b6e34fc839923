"""`r1 compare RUN_A RUN_B`: two pipeline runs stage by stage: the params that differ, the metrics side by side,
and the MLflow UI's pages for both and for their comparison.

A pipeline run is an MLflow parent run; its stages are the child runs tagged `stage=<name>`. Upstream URIs
(`input.*` params) differ between any two runs by construction, so they are left out of the diff.
"""

from __future__ import annotations

from mlflow.entities import Run

from grpo.recipe import STAGES
from tasks import tracking

HIDDEN_PARAMS = ("input.",)  # always differ (each run points at its own upstream runs)


def stage_runs(parent_run_id: str) -> dict[str, Run]:
    """The pipeline's child runs by stage, in recipe order (the newest finished one where a stage ran twice)."""
    client = tracking.client()
    parent = client.get_run(parent_run_id)  # raises MlflowException for an unknown id
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
                                  order_by=["attributes.start_time ASC"])
    by_stage: dict[str, Run] = {}
    for run in children:
        stage = run.data.tags.get("stage")
        if stage and (stage not in by_stage or run.info.status == "FINISHED"
                      or by_stage[stage].info.status != "FINISHED"):
            by_stage[stage] = run
    order = {name: i for i, name in enumerate(STAGES)}
    return dict(sorted(by_stage.items(), key=lambda kv: order.get(kv[0], len(order))))


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def diff_params(a: dict[str, str], b: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(HIDDEN_PARAMS))
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def side_by_side(a: dict[str, float], b: dict[str, float]) -> list[tuple[str, float | None, float | None]]:
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))]


def compare(run_a: str, run_b: str) -> str:
    """The comparison as text (what `r1 compare` prints)."""
    stages_a, stages_b = stage_runs(run_a), stage_runs(run_b)
    if not stages_a and not stages_b:
        raise ValueError(f"neither {run_a} nor {run_b} has stage runs (child runs tagged `stage`): "
                         "are they pipeline runs?")
    client = tracking.client()
    parent_a, parent_b = client.get_run(run_a), client.get_run(run_b)
    width = max([28] + [len(k) + 2 for runs in (stages_a, stages_b) for r in runs.values()
                        for k in (*r.data.params, *r.data.metrics)])
    row = lambda name, x, y, extra="": f"    {name:<{width}} {_fmt(x):>14} {_fmt(y):>14}{extra}"  # noqa: E731
    head = lambda title, extra="": f"  {title:<{width + 2}} {'A':>14} {'B':>14}{extra}"  # noqa: E731
    lines = [f"A: {run_a}  {parent_a.info.run_name}  {parent_a.info.status}",
             f"B: {run_b}  {parent_b.info.run_name}  {parent_b.info.status}"]
    pipeline_diff = diff_params(parent_a.data.params, parent_b.data.params)
    pipeline_diff = [d for d in pipeline_diff if not d[0].startswith("from.")]
    if pipeline_diff:
        lines += ["", head("pipeline params that differ")]
        lines += [row(k, x, y) for k, x, y in pipeline_diff]
    for stage in {**stages_a, **stages_b}:  # A's order, then stages only B ran
        ra, rb = stages_a.get(stage), stages_b.get(stage)
        ids = f"A {ra.info.run_id if ra else '(not run)'}, B {rb.info.run_id if rb else '(not run)'}"
        lines += ["", f"== {stage}  ({ids})"]
        params = diff_params(ra.data.params if ra else {}, rb.data.params if rb else {})
        lines.append(head("params that differ") if params else "  params that differ: none")
        lines += [row(k, x, y) for k, x, y in params]
        metrics = side_by_side(ra.data.metrics if ra else {}, rb.data.metrics if rb else {})
        lines.append(head("metrics (last value)", "  B-A"))
        for k, x, y in metrics:
            delta = f"  {y - x:+.4g}" if x is not None and y is not None else ""
            lines.append(row(k, x, y, delta))
    lines += ["", tracking.ui_text({"A": run_a, "B": run_b})]
    return "\n".join(lines)
