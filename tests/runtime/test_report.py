"""Each stage publishes a Prefect markdown artifact: headline metrics, outputs, and a link to its MLflow run."""

from __future__ import annotations

from grpo.configs.recipe import ColdStartSFTConfig
from runtime.report import stage_report_markdown
from runtime.stage import StageResult
from tiny_configs import TINY_STAGE


def test_the_report_links_to_the_run_on_an_mlflow_server():
    result = StageResult(stage="sft", run_id="abc123", uris={"checkpoint": "runs:/abc123/checkpoint"},
                         metrics={"eval/accuracy": 0.3125, "eval/format_rate": 1.0})
    text = stage_report_markdown(result, "7", "http://mlflow.team:5000/")
    assert "[`abc123`](http://mlflow.team:5000/#/experiments/7/runs/abc123?workflowType=machine_learning)" in text
    assert "| eval/accuracy | 0.3125 |" in text and "| checkpoint | `runs:/abc123/checkpoint` |" in text
    local = stage_report_markdown(result, "7", "sqlite:////tmp/m.db")
    assert "mlflow ui --backend-store-uri sqlite:////tmp/m.db" in local and "](" not in local


def test_a_stage_flow_publishes_its_report(prefect_harness, mlflow_client):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from flows.cold_start_sft import cold_start_sft

    result = cold_start_sft(ColdStartSFTConfig.model_validate(TINY_STAGE))
    flow_run_id = mlflow_client.get_run(result.run_id).data.tags["prefect.flow_run_id"]
    with get_client(sync_client=True) as client:
        # other tests in the session ran this stage too: this flow run's report
        [artifact] = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["cold-start-sft-report"]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    assert artifact.type == "markdown"
    assert result.run_id in artifact.data and "## cold_start_sft" in artifact.data
    assert f"| eval/accuracy | {result.metrics['eval/accuracy']:.4g} |" in artifact.data
    assert result.uris["checkpoint"] in artifact.data
