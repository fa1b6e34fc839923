"""Task: supervised fine-tuning (cold-start SFT, and SFT on curated data)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.core import ModelConfig, SFTConfig
from grpo.configs.distributed import DistributedConfig
from grpo.data.tables import validate_rows
from grpo.training.launchers import launch
from grpo.training.launchers.jobs import SFTJob, run
from runtime import cluster, tracking
from runtime.durable import durable_resume
from runtime.progress import TrainingProgress
from runtime.stage import log_gemm_plan, resolve_precision, work_dir
from tasks.data import read_frame


@task(name="train_sft_model")
def train_sft_model(run_id: str, stage: str, model_cfg: ModelConfig, train_uri: str, cfg: SFTConfig,
                    distributed: DistributedConfig = DistributedConfig()) -> str:
    """Fine-tune the model on the training rows; log per-step metrics; return the checkpoint's URI."""
    rows_path = str(tracking.download(train_uri))  # Parquet
    rows = pd.read_parquet(rows_path)
    processes = launch.check_splits(distributed, train__batch_size=cfg.batch_size)  # before any model loads
    ray_address = cluster.check_training_cluster(distributed, stage)  # None: this machine's processes
    cfg = resolve_precision(run_id, "train", cfg)
    # keyed by what determines the result, so rerunning an interrupted stage resumes from its last checkpoint
    keys = (model_cfg, cfg, rows["prompt"].astype(str).tolist(), rows["response"].tolist())
    out = work_dir(run_id, stage, *keys, *launch.resume_key(distributed), root=launch.work_root(distributed))
    with durable_resume(run_id, out) as step:  # its newest checkpoint, wherever it ran before; copies of new ones
        if step:
            get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
        progress = TrainingProgress(run_id, stage, cfg.max_steps)
        job = SFTJob(model=model_cfg, cfg=cfg, rows=rows_path, source=train_uri, output_dir=str(out),
                     distributed=distributed)
        if launch.is_launched(distributed):
            get_run_logger().info("training on %d processes (%s)", processes,
                                  "Ray Train" if ray_address else "accelerate launch")
            report = launch.run_launched(job, progress, ray_address=ray_address)
        else:
            report = run(job, progress)
        model_dir, steps, final_loss = Path(report["model_dir"]), report["steps"], report["final_loss"]
    get_run_logger().info("SFT finished: %d steps, final loss %.4f", steps, final_loss)
    log_gemm_plan(run_id, "train", out)
    return tracking.log_dir(run_id, model_dir, "checkpoint")


@task(name="prepare_sft_mix")
def prepare_sft_mix(run_id: str, dataset_uri: str, cold_start_uri: str | None = None) -> str:
    """The stage-4 training rows: the curated dataset, plus the cold-start rows when given; logged as inputs."""
    curated = read_frame(dataset_uri)
    validate_rows(curated, {"prompt": "text or chat messages", "response": "text"}, dataset_uri)
    tracking.log_dataset(run_id, curated, name="curated", source=dataset_uri, context="training")
    parts = [curated[["prompt", "response"]]]
    if cold_start_uri:
        cold = read_frame(cold_start_uri)
        tracking.log_dataset(run_id, cold, name="cold_start", source=cold_start_uri, context="training")
        parts.append(cold[["prompt", "response"]])
    rows = pd.concat(parts, ignore_index=True)
    get_run_logger().info("SFT rows: %d curated%s", len(curated),
                          f" + {len(rows) - len(curated)} cold-start" if cold_start_uri else "")
    return tracking.log_frame(run_id, rows, "dataset/train")
