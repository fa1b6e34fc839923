"""A retried pipeline flow run carries on in its MLflow parent run and does not run its finished stages again.

Prefect retries a flow run by running the flow function again under the same flow run id (run_count 2, 3, ...):
in process when the flow has `retries`, and on a worker after *Retry* in the UI, which sets the failed run's state
to Scheduled/AwaitingRetry (the UI's own request: `set_state` with force). Both paths are tested here; the sft stage
fails before training (its model folder does not exist) once cold_start_sft has finished.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pandas as pd
import pytest
import yaml

from tiny_configs import TINY_SFT, TINY_STAGE


def write_recipe(path, name: str, sft_model: str | None) -> None:
    sft = TINY_SFT if sft_model is None else {**TINY_SFT, "model": {"name_or_path": sft_model}}
    path.write_text(yaml.safe_dump({"name": name, "cold_start_sft": {**TINY_STAGE, "eval": {**TINY_STAGE["eval"],
                                                                                          "num_samples": 0}},
                                    "sft": sft}))


@pytest.fixture
def curated(tmp_path):
    """A stand-in for stage 3's output, so the pipeline here is cold_start_sft then sft."""
    path = tmp_path / "curated.parquet"
    pd.DataFrame({"prompt": [f"What is {i}+1?" for i in range(16)],
                  "response": [f"<think>{i} and 1.</think><answer>{i + 1}</answer>" for i in range(16)]}
                 ).to_parquet(path)
    return str(path)


def pipeline_runs(mlflow_client, recipe_name: str):
    """The parent run of the pipeline runs of this recipe, and its stage runs by stage."""
    experiments = [e.experiment_id for e in mlflow_client.search_experiments()]
    [parent] = mlflow_client.search_runs(experiments, f"tags.recipe = '{recipe_name}'")
    children = mlflow_client.search_runs(experiments, f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                         order_by=["attributes.start_time ASC"])
    by_stage: dict[str, list] = {}
    for run in children:
        by_stage.setdefault(run.data.tags["stage"], []).append(run)
    return parent, by_stage


async def _flow_run_and_logs(flow_run_id: str, expect: str):
    """The flow run and its logs' messages, once one holds `expect` (or 60 s on): the flow's log lines reach the
    API from a background handler in batches, and on a busy machine the last batch can land after the flow returns."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + 60
    async with get_client() as client:
        while True:
            flow_run = await client.read_flow_run(uuid.UUID(flow_run_id))
            logs = [log.message for log in await client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))]
            if any(expect in m for m in logs) or time.monotonic() > deadline:
                return flow_run, logs
            await asyncio.sleep(0.5)


def test_flow_retries_skip_the_stages_the_first_attempt_finished(prefect_harness, mlflow_client, curated, tmp_path):
    from flows.r1_pipeline import r1_pipeline

    recipe = tmp_path / "retry.yaml"
    missing = tmp_path / "no-such-model"
    write_recipe(recipe, "retry-in-process", str(missing))
    with pytest.raises(Exception, match="no-such-model"):
        r1_pipeline.with_options(retries=1, retry_delay_seconds=0)(
            recipe=str(recipe), stages=["cold_start_sft", "sft"], from_uris={"curated_dataset": curated})

    parent, stages = pipeline_runs(mlflow_client, "retry-in-process")  # one parent for both attempts
    assert parent.info.status == "FAILED"
    assert len(stages["cold_start_sft"]) == 1 and stages["cold_start_sft"][0].info.status == "FINISHED"
    assert [r.info.status for r in stages["sft"]] == ["FAILED", "FAILED"]  # sft was tried by both attempts
    flow_run, logs = asyncio.run(_flow_run_and_logs(parent.data.tags["prefect.flow_run_id"],
                                                    "skipping finished stages"))
    assert flow_run.run_count == 2 and flow_run.state.is_failed()
    assert any("attempt 2" in m and "skipping finished stages: cold_start_sft" in m for m in logs), logs


def test_retry_from_the_ui_finishes_the_run_without_repeating_stages(prefect_harness, mlflow_client, curated,
                                                                       tmp_path):
    from prefect.flow_engine import run_flow
    from prefect.states import AwaitingRetry

    from flows.r1_pipeline import r1_pipeline
    from prefect.client.orchestration import get_client

    recipe = tmp_path / "retry.yaml"
    write_recipe(recipe, "retry-from-ui", str(tmp_path / "no-such-model"))
    with pytest.raises(Exception, match="no-such-model"):
        # fresh: its cold start trains here, though an earlier test of this worker may have finished one with the
        # same key (then it would be reused); the retry keeps the parameter and skips what this run finished
        r1_pipeline(recipe=str(recipe), stages=["cold_start_sft", "sft"], from_uris={"curated_dataset": curated},
                    fresh=True)
    parent, first = pipeline_runs(mlflow_client, "retry-from-ui")
    flow_run_id = parent.data.tags["prefect.flow_run_id"]

    write_recipe(recipe, "retry-from-ui", None)  # the fix: the recipe's sft model is the tiny one again

    async def retry_as_the_ui_does():
        async with get_client() as client:
            await client.set_flow_run_state(uuid.UUID(flow_run_id), AwaitingRetry(message="Retry from the UI"),
                                            force=True)
            return await client.read_flow_run(uuid.UUID(flow_run_id))

    flow_run = asyncio.run(retry_as_the_ui_does())
    # what a worker does with the scheduled run: the flow engine runs the same flow run with its parameters
    result = run_flow(r1_pipeline, flow_run=flow_run, parameters=flow_run.parameters)

    assert result.run_id == parent.info.run_id
    parent, stages = pipeline_runs(mlflow_client, "retry-from-ui")
    assert parent.info.status == "FINISHED"
    assert [r.info.run_id for r in stages["cold_start_sft"]] == [first["cold_start_sft"][0].info.run_id]
    assert [r.info.status for r in stages["sft"]] == ["FAILED", "FINISHED"]
    assert result.stages["cold_start_sft"].run_id == first["cold_start_sft"][0].info.run_id
    assert result.stages["cold_start_sft"].uris["checkpoint"] == parent.data.tags["uri.cold_start_checkpoint"]
    assert parent.data.tags["uri.sft_checkpoint"] == result.stages["sft"].uris["checkpoint"]
    flow_run, logs = asyncio.run(_flow_run_and_logs(flow_run_id, "skipping finished stages"))
    assert flow_run.run_count == 2 and flow_run.state.is_completed()
    assert any("skipping finished stages: cold_start_sft" in m for m in logs), logs
