"""Long stages show their progress in Prefect: a progress artifact per training task that reaches 100 at the end."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from grpo.configs.recipe import ColdStartSFTConfig, ReasoningGRPOConfig
from tiny_configs import TINY_GRPO, TINY_STAGE


async def _artifacts(flow_run_id: str) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        found = await client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])))
    return {a.key: a for a in found}


def test_sft_and_grpo_stages_report_progress_to_100(prefect_harness, mlflow_client, monkeypatch):
    from flows.cold_start_sft import cold_start_sft
    from flows.reasoning_grpo import reasoning_grpo

    no_eval = {"num_train": 32, "num_heldout": 0}
    monkeypatch.setenv("R1_STEP_PAUSE_S", "0.05")  # a stage slowed down for a test says so on its run
    sft = cold_start_sft(ColdStartSFTConfig.model_validate({**TINY_STAGE, "data": no_eval}))
    assert mlflow_client.get_run(sft.run_id).data.tags["r1.step_pause_s"] == "0.05"
    monkeypatch.delenv("R1_STEP_PAUSE_S")
    grpo = reasoning_grpo(sft.uris["checkpoint"], ReasoningGRPOConfig.model_validate({**TINY_GRPO, "data": no_eval}))

    for result, key, steps in ((sft, "cold-start-sft-progress", 4), (grpo, "reasoning-grpo-progress", 2)):
        flow_run_id = mlflow_client.get_run(result.run_id).data.tags["prefect.flow_run_id"]
        artifacts = asyncio.run(_artifacts(flow_run_id))
        assert key in artifacts, sorted(artifacts)
        progress = artifacts[key]
        assert progress.type == "progress" and float(progress.data) == 100.0
        assert f"of {steps}" in progress.description
        assert progress.updated > progress.created  # created at 0 when training started, moved since
        # the same callback still logs the metrics to MLflow
        assert mlflow_client.get_metric_history(result.run_id, "train/loss" if steps == 4 else "reward/total")
    assert "r1.step_pause_s" not in mlflow_client.get_run(grpo.run_id).data.tags


def test_a_step_pause_is_a_number_of_seconds(monkeypatch):
    from runtime.progress import step_pause_s

    for text, pause in (("", 0.0), ("0", 0.0), ("0.25", 0.25), (" 2 ", 2.0)):
        monkeypatch.setenv("R1_STEP_PAUSE_S", text)
        assert step_pause_s() == pause
    for text in ("-1", "soon", "nan"):
        monkeypatch.setenv("R1_STEP_PAUSE_S", text)
        with pytest.raises(ValueError, match=f"R1_STEP_PAUSE_S='{text}': expected a number of seconds >= 0"):
            step_pause_s()
