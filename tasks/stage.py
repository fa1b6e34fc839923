"""What every stage shares: its result record, its MLflow child run, its working folder, model resolution."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel, ConfigDict

from grpo.config import ModelConfig
from tasks import tracking


class StageResult(BaseModel):
    """What a stage hands the next one: its MLflow run and the URIs it produced (never tensors or pickles)."""

    model_config = ConfigDict(frozen=True)

    stage: str  # cold_start_sft, reasoning_grpo, rejection_sampling, sft, alignment_grpo
    run_id: str  # the stage's MLflow child run
    uris: dict[str, str]  # e.g. {"checkpoint": "runs:/<id>/checkpoint", "dataset": "runs:/<id>/dataset"}
    metrics: dict[str, float] = {}  # the stage's headline numbers (eval/accuracy, ...)


class PipelineResult(BaseModel):
    """A pipeline run: its MLflow parent run and each stage's result, in order."""

    model_config = ConfigDict(frozen=True)

    run_id: str  # the MLflow parent run
    stages: dict[str, StageResult]


def prefect_tags() -> dict[str, str]:
    """The Prefect flow run this code runs in, as MLflow tags (empty outside a flow run)."""
    from prefect.runtime import flow_run

    tags = {}
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
        tags["prefect.flow_run_name"] = str(flow_run.name)
        if flow_run.ui_url:
            tags["prefect.flow_run_url"] = str(flow_run.ui_url)
    return tags


def earlier_attempt_run() -> str | None:
    """On a Prefect retry of the current flow run (same id, run_count > 1): the MLflow run its first attempt made.

    Prefect retries a flow run by running its function again under the same flow run id, whether the flow has
    `retries` or someone pressed *Retry* in the UI; the run's `prefect.flow_run_id` tag finds what it made before.
    """
    from prefect.runtime import flow_run

    if not flow_run.id or flow_run.run_count <= 1:
        return None
    runs = tracking.find_runs(f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
    return runs[-1].info.run_id if runs else None  # the oldest: the first attempt's


@contextmanager
def stage_run(stage: str, config: BaseModel, parent_run_id: str | None,
              inputs: dict[str, str] | None = None) -> Iterator[str]:
    """An MLflow child run tagged `stage=<stage>` with the config as params; marked FAILED if the body raises.

    `inputs` (the upstream URIs) are logged as params and tags, so a run records what it was built from.
    """
    inputs = inputs or {}
    run_id = tracking.start_run(stage, tags={"stage": stage, **prefect_tags(), **{f"input.{k}": v for k, v in
                                                                                 inputs.items()}},
                                parent_run_id=parent_run_id, config=config)
    if inputs:
        tracking.log_params(run_id, {f"input.{k}": v for k, v in inputs.items()})
    try:
        yield run_id
    except BaseException:
        tracking.end_run(run_id, "FAILED")
        raise
    tracking.end_run(run_id, "FINISHED")


def log_precision(run_id: str, section: str, requested: str) -> str:
    """Resolve the config's mixed_precision on this machine and log it as `<section>.resolved_precision`."""
    from grpo.training.precision import choose_precision

    precision = choose_precision(requested)
    tracking.log_params(run_id, {f"{section}.resolved_precision": precision})
    return precision


def work_dir(stage: str, *keys) -> Path:
    """A working folder keyed by the stage's inputs, so a rerun with the same inputs finds (and resumes) its work."""
    blob = json.dumps([k.model_dump(mode="json") if isinstance(k, BaseModel) else k for k in keys], sort_keys=True)
    path = tracking.r1_home() / "work" / stage / hashlib.sha256(blob.encode()).hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model(cfg: ModelConfig, uri: str | None) -> ModelConfig:
    """The model config with `name_or_path` pointing at a local copy of `uri` (a checkpoint artifact), if given."""
    if uri is None:
        return cfg
    return cfg.model_copy(update={"name_or_path": str(tracking.download(uri))})
