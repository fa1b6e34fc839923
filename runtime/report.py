"""A stage's report in Prefect: a markdown artifact with its headline metrics, its outputs and its MLflow run."""

from __future__ import annotations

from runtime import tracking, ui_links
from runtime.stage import StageResult, record_result


def mlflow_run_url(run_id: str, experiment_id: str, tracking_uri: str) -> str | None:
    """The run's page in the MLflow UI when tracking goes to a server; None for a local SQLite store."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return ui_links.ui_links({run_id: experiment_id}, tracking_uri)[run_id]


def stage_report_markdown(result: StageResult, experiment_id: str, tracking_uri: str) -> str:
    url = mlflow_run_url(result.run_id, experiment_id, tracking_uri)
    run = f"[`{result.run_id}`]({url})" if url else f"`{result.run_id}` in `{tracking_uri}`"
    lines = [f"## {result.stage}", "", f"MLflow run: {run}", ""]
    if not url:  # a local store has no server to link to: say how to open one
        lines += [f"Browse it: `{ui_links.ui_command(tracking_uri)}`", ""]
    if result.metrics:
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in sorted(result.metrics.items())] + [""]
    lines += ["| output | URI |", "|---|---|"] + [f"| {k} | `{v}` |" for k, v in result.uris.items()]
    return "\n".join(lines)


def publish_stage_report(result: StageResult) -> None:
    """Record the result on the stage's MLflow run (where a pipeline that placed the stage elsewhere reads it) and
    attach the stage's report to the current flow run (key `<stage>-report`, one version per run)."""
    from prefect.artifacts import create_markdown_artifact

    record_result(result)
    experiment_id = tracking.client().get_run(result.run_id).info.experiment_id
    create_markdown_artifact(stage_report_markdown(result, experiment_id, tracking.tracking_uri()),
                             key=f"{result.stage.replace('_', '-')}-report",
                             description=f"{result.stage}: headline metrics and MLflow run {result.run_id}")
