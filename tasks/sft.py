"""Task: supervised fine-tuning (cold-start SFT, and SFT on curated data)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.distributed import DistributedConfig
from grpo.configs.model import ModelConfig
from grpo.configs.training import SFTConfig
from grpo.data.row_files import check_row_files, content_digest, parquet_files
from grpo.data.tables import SFT_SCHEMA
from grpo.training.launchers import launch
from grpo.training.jobs import SFTJob, run
from runtime import cluster, dataset_refs, tracking
from runtime.durable import durable_resume
from runtime.progress import TrainingProgress
from runtime.stage import log_gemm_plan, resolve_precision, work_dir


@task(name="train_sft_model")
def train_sft_model(run_id: str, stage: str, model_cfg: ModelConfig, train_uri: str | list[str], cfg: SFTConfig,
                    distributed: DistributedConfig = DistributedConfig()) -> str:
    """Fine-tune the model on the training rows (a Parquet artifact, or several read in order as one table); log
    per-step metrics; return the checkpoint's URI."""
    uris = [train_uri] if isinstance(train_uri, str) else list(train_uri)
    paths = [str(tracking.download(uri)) for uri in uris]  # Parquet files or folders of them, read where they lie
    processes = launch.check_splits(distributed, train__batch_size=cfg.batch_size)  # before any model loads
    ray_address = cluster.check_training_cluster(distributed, stage)  # None: this machine's processes
    cfg = resolve_precision(run_id, "train", cfg)
    # keyed by what determines the result, so rerunning an interrupted stage resumes from its last checkpoint
    keys = (model_cfg, cfg, [content_digest(parquet_files(p)) for p in paths])
    out = work_dir(run_id, stage, *keys, *launch.resume_key(distributed), root=launch.work_root(distributed))
    with durable_resume(run_id, out) as step:  # its newest checkpoint, wherever it ran before; copies of new ones
        if step:
            get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
        progress = TrainingProgress(run_id, stage, cfg.max_steps)
        job = SFTJob(model=model_cfg, cfg=cfg, rows=paths, source=" + ".join(uris), output_dir=str(out),
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
def prepare_sft_mix(run_id: str, dataset_uri: str, cold_start_uri: str | None = None) -> list[str]:
    """The stage-4 training rows: the curated dataset, then the cold-start rows when given. Every row is checked
    here, a batch at a time (a bad one names its file, row and column), and each is logged as an input by
    reference; the URIs come back as they are, for training to read in that order."""
    uris = [dataset_uri, *([cold_start_uri] if cold_start_uri else [])]
    rows = []
    for uri, name in zip(uris, ("curated", "cold_start")):
        dataset = check_row_files(tracking.download(uri), SFT_SCHEMA, uri)
        dataset_refs.log_dataset_reference(run_id, dataset, name=name, source=uri, context="training")
        rows.append(dataset.rows)
    get_run_logger().info("SFT rows: %d curated%s", rows[0], f" + {rows[1]} cold-start" if cold_start_uri else "")
    return uris
