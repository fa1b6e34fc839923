"""Stage and pipeline runs as the tests read them back from MLflow: a pipeline's stage runs, a checkpoint's weights,
a curated dataset; and the runs some tests make to read (a made-up pipeline, a rejection-sampling stage section)."""

from __future__ import annotations

from pathlib import Path

from tiny_configs import TINY_MODEL


def children(client, parent_run_id: str) -> dict:
    """A pipeline run's stage runs by stage (the newest where a stage has two)."""
    runs = client.search_runs([client.get_run(parent_run_id).info.experiment_id],
                              f"tags.`mlflow.parentRunId` = '{parent_run_id}'", order_by=["attributes.start_time ASC"])
    return {r.data.tags["stage"]: r for r in runs}


def weights(checkpoint_uri: str, dst: Path) -> dict:
    """A logged checkpoint's weights (name: tensor), downloaded into `dst`."""
    from safetensors.torch import load_file

    from runtime.tracking import download

    return load_file(download(checkpoint_uri, dst) / "model.safetensors")


def stage_run(run, stage: str):
    """The RUNNING MLflow run of `stage` made by `run` (a processes.R1), or None."""
    return next((r for r in run.runs() if r.data.tags.get("stage") == stage and r.info.status == "RUNNING"), None)


def curated(uri: str):
    """A curated dataset's rows (a DataFrame of prompt, response, sample_index), prompts as text."""
    from tasks.data import read_frame

    rows = read_frame(uri)
    return rows.assign(prompt=rows["prompt"].astype(str))[["prompt", "response", "sample_index"]]


def stage_config(prompts_file: str, **rejection) -> dict:
    """A rejection-sampling section on the answering checkpoint's model, reading `prompts_file` (conftest's
    `prompts_file`: 48 prompts)."""
    return {
        "model": {"tiny": TINY_MODEL.model_dump()},
        "data": {"source": prompts_file, "num_train": 48, "num_heldout": 0},
        "rejection": {"samples_per_prompt": 4, "sampling": {"max_new_tokens": 32}, "target_samples": 60,
                      "shard_size": 3, "decontamination_ngram": 0, **rejection},
    }


def make_pipeline(lr: str, accuracy: float, stages=("cold_start_sft", "reasoning_grpo"), recipe="tiny") -> str:
    """A finished pipeline run with a stage run per stage, made through the real MLflow client: its run id."""
    from runtime import tracking

    parent = tracking.start_run(f"r1_pipeline:{recipe}", tags={"recipe": recipe})
    tracking.log_params(parent, {"recipe": recipe, "stages": ",".join(stages)})
    for stage in stages:
        child = tracking.start_run(stage, tags={"stage": stage}, parent_run_id=parent)
        tracking.log_params(child, {"train.learning_rate": lr, "train.max_steps": "4",
                                    "input.checkpoint_uri": f"runs:/{parent}/x"})
        log = tracking.MetricsLogger(child)
        log(1, {"train/loss": 2.0, "eval/accuracy": 0.0})
        log(4, {"train/loss": 1.0, "eval/accuracy": accuracy})
        tracking.end_run(child)
    tracking.end_run(parent)
    return parent
