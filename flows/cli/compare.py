"""`r1 compare RUN_A RUN_B [RUN ...]`: pipeline runs stage by stage: the params that differ, the metrics side by
side, and the MLflow UI's pages for each and for their comparison. A sweep run (`r1 sweep`) stands for its points.
`r1 show RUN`: one pipeline run's every figure, stage by stage (what the summary `r1 run` ends with leaves out).

A pipeline run is an MLflow parent run; its stages are the child runs tagged `stage=<name>`. Upstream URIs
(`input.*` params) differ between any two runs by construction, so they are left out of the diff; a stage one run
reused from another is compared by the params of the run that did the work; the machine's `system/*` figures are
left to the MLflow UI.
"""

from __future__ import annotations

from mlflow.entities import Run

from grpo.configs.recipe import STAGES
from runtime import tracking, ui_links

HIDDEN_PARAMS = ("input.",)  # always differ (each run points at its own upstream runs)
# the machine's figures (CPU, memory, GPU use over time): not results, and in the MLflow UI's system metrics tab
HIDDEN_METRICS = ("system/",)


def _worked(run: Run | None) -> Run | None:
    """The run that did a stage's work: a reused stage's run (`r1.reused_from`) holds no params of its own, so
    its params are the run it reused."""
    from runtime.reuse import REUSED_FROM

    origin = run.data.tags.get(REUSED_FROM) if run is not None else None
    if not origin:
        return run
    try:
        return tracking.client().get_run(origin)
    except Exception:  # deleted since: what the reusing run holds
        return run


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


def diff_params(*runs: dict[str, str]) -> list[tuple]:
    """(key, value in each run) for the params whose values are not all the same."""
    keys = sorted(k for k in set().union(*runs) if not k.startswith(HIDDEN_PARAMS))
    return [(k, *(r.get(k) for r in runs)) for k in keys if len({r.get(k) for r in runs}) > 1]


def side_by_side(*runs: dict[str, float]) -> list[tuple]:
    return [(k, *(r.get(k) for r in runs)) for k in sorted(set().union(*runs))]


def expand_runs(run_ids: list[str]) -> list[str]:
    """The pipeline runs to compare: each id as given, a sweep run (flows/sweep.py) as its finished points in order."""
    client = tracking.client()
    out = []
    for run_id in run_ids:
        run = client.get_run(run_id)  # raises MlflowException for an unknown id
        if "r1.sweep.key" in run.data.tags:
            points = tracking.find_runs(f"tags.`r1.sweep` = '{run_id}' and attributes.status = 'FINISHED'")
            points = sorted(points, key=lambda p: int(p.data.tags.get("r1.sweep.index", 0)))
            out += list(dict.fromkeys(p.info.run_id for p in points))
        else:
            out.append(run_id)
    return out


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"R{i + 1}"


def compare(*run_ids: str) -> str:
    """The comparison as text (what `r1 compare` prints): two pipeline runs or more (a sweep run stands for its
    points), each a column; with two, B-A beside each metric."""
    ids = expand_runs(list(run_ids))
    if len(ids) < 2:
        raise ValueError(f"{' '.join(run_ids)}: {len(ids)} pipeline run(s) to compare; give two or more (or a sweep "
                         "run with two finished points or more)")
    stages = [stage_runs(i) for i in ids]
    if not any(stages):
        raise ValueError(f"none of {', '.join(ids)} has stage runs (child runs tagged `stage`): are they pipeline "
                         "runs?")
    client = tracking.client()
    parents = [client.get_run(i) for i in ids]
    letters = [_letter(i) for i in range(len(ids))]
    two = len(ids) == 2
    width = max([28] + [len(k) + 2 for runs in stages for r in runs.values() for k in (*r.data.params,
                                                                                       *r.data.metrics)])
    row = lambda name, values, extra="": (f"    {name:<{width}} " + " ".join(f"{_fmt(v):>14}" for v in values)
                                          + extra)  # noqa: E731
    head = lambda title, extra="": (f"  {title:<{width + 2}} " + " ".join(f"{x:>14}" for x in letters)
                                    + extra)  # noqa: E731
    lines = [f"{x}: {p.info.run_id}  {p.info.run_name}  {p.info.status}" for x, p in zip(letters, parents)]
    pipeline_diff = [d for d in diff_params(*(p.data.params for p in parents)) if not d[0].startswith("from.")]
    if pipeline_diff:
        lines += ["", head("pipeline params that differ")]
        lines += [row(k, values) for k, *values in pipeline_diff]
    order = {}
    for runs in stages:  # the first run's order, then stages only later runs ran
        order.update(dict.fromkeys(runs))
    from runtime.reuse import REUSED_FROM

    for stage in order:
        these = [runs.get(stage) for runs in stages]
        ran = ", ".join(f"{x} {r.info.run_id if r else '(not run)'}"
                        + (f" (reused {r.data.tags[REUSED_FROM]})" if r and r.data.tags.get(REUSED_FROM) else "")
                        for x, r in zip(letters, these))
        lines += ["", f"== {stage}  ({ran})"]
        worked = [_worked(r) for r in these]
        params = diff_params(*(r.data.params if r else {} for r in worked))
        lines.append(head("params that differ") if params else "  params that differ: none")
        lines += [row(k, values) for k, *values in params]
        lines.append(head("metrics (last value)", "  B-A" if two else ""))
        shown = [{k: v for k, v in (r.data.metrics if r else {}).items() if not k.startswith(HIDDEN_METRICS)}
                 for r in these]
        for k, *values in side_by_side(*shown):
            delta = f"  {values[1] - values[0]:+.4g}" if two and None not in values else ""
            lines.append(row(k, values, delta))
    lines += ["", ui_links.ui_text(dict(zip(letters, ids)))]
    return "\n".join(lines)


def show(run_id: str) -> str:
    """Every figure a pipeline run's stages logged (the last value of each), stage by stage, with the URIs each made
    and the run's MLflow UI page; a stage run (a run with no stage runs under it) alone. A reused stage's figures are
    those of the run that did its work, with what the reusing run logged itself. What `r1 show` prints."""
    from runtime.reuse import REUSED_FROM
    from runtime.stage import read_result

    run = tracking.client().get_run(run_id)  # raises MlflowException for an unknown id
    stages = stage_runs(run_id) or {run.data.tags.get("stage", run.info.run_name): run}
    lines = [f"{run.info.run_id}  {run.info.run_name}  {run.info.status}"]
    for stage, r in stages.items():
        worked = _worked(r)
        reused = f", reused {r.data.tags[REUSED_FROM]}" if r.data.tags.get(REUSED_FROM) else ""
        lines += ["", f"== {stage}  (run {r.info.run_id}, {r.info.status}{reused})"]
        metrics = {k: v for k, v in {**worked.data.metrics, **r.data.metrics}.items()
                   if not k.startswith(HIDDEN_METRICS)}
        width = max(map(len, metrics), default=0)
        lines += [f"  {k:<{width}}  {_fmt(v)}" for k, v in sorted(metrics.items())] or ["  no metrics"]
        result = read_result(r)
        lines += [f"  {key}: {uri}" for key, uri in (result.uris if result else {}).items()]
    lines += ["", ui_links.ui_text({"run": run_id})]
    return "\n".join(lines)
