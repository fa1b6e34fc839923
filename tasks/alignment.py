"""Tasks of the alignment stage: the reward model and the mixed prompt set, DPO in their place (`algorithm: dpo`),
and the refusal figures every algorithm logs (registering the final model and promoting it: `tasks.promotion`)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.core import ModelConfig
from grpo.configs.recipe import AlignmentGRPOConfig
from grpo.data.preferences import alignment_prompts, general_prompts, load_preference_data
from grpo.data.tables import load_rl_data, read_table, validate_rows
from grpo.training.launchers import launch
from grpo.training.launchers.jobs import DPOJob, RewardModelJob, run, write_frame
from grpo.training.loops.reward_model import RewardModelResult
from runtime import cluster, tracking
from runtime.durable import durable_resume
from runtime.progress import TrainingProgress
from runtime.stage import resolve_model, resolve_precision, work_dir
from tasks.data import DataURIs, report_dropped


@task(name="prepare_alignment_prompts")
def prepare_alignment_prompts(run_id: str, cfg: AlignmentGRPOConfig) -> DataURIs:
    """Reasoning prompts (answer: rule rewards) mixed with general ones (kind=general: the reward model)."""
    reasoning, heldout = load_rl_data(cfg.data)
    if cfg.general_source == "synthetic":
        general = general_prompts(cfg.general_prompts, seed=cfg.data.task.seed)
    else:
        general = validate_rows(read_table(cfg.general_source), {"prompt": "text or chat messages"},
                                cfg.general_source).iloc[: cfg.general_prompts]
        general = general.assign(kind="general")[["prompt", "kind"]]
    rows = alignment_prompts(reasoning, general)
    source = cfg.data.source if cfg.data.source != "synthetic" else f"synthetic:{cfg.data.task.model_dump_json()}"
    tracking.log_dataset(run_id, rows, name="alignment_prompts", source=f"{source}+general:{cfg.general_source}",
                         context="training")
    train_uri = tracking.log_frame(run_id, rows, "dataset/train")
    heldout_uri = tracking.log_frame(run_id, heldout, "dataset/heldout") if heldout is not None else None
    get_run_logger().info("alignment prompts: %d reasoning + %d general", len(reasoning), len(general))
    report_dropped(run_id, cfg.data, reasoning, heldout)
    return DataURIs(train_uri, heldout_uri)


@task(name="train_reward_model")
def train_reward_model_task(run_id: str, cfg: AlignmentGRPOConfig) -> str:
    """Fit the reward model on preference pairs (Bradley-Terry); log its figures; return its URI."""
    if cfg.reward_model_uri:
        return cfg.reward_model_uri
    pairs, heldout = load_preference_data(cfg.preferences)
    launch.check_splits(cfg.distributed, reward_model__batch_size=cfg.reward_model.batch_size)
    ray_address = cluster.check_training_cluster(cfg.distributed, "alignment_grpo")  # None: this machine's
    tracking.log_dataset(run_id, pairs.astype(str), name="preferences", source=cfg.preferences.source,
                         context="reward_model")
    launched = launch.is_launched(cfg.distributed)
    rm_cfg = resolve_precision(run_id, "reward_model", cfg.reward_model)
    out = work_dir(run_id, "reward_model", cfg.preferences, rm_cfg, *launch.resume_key(cfg.distributed),
                   root=launch.work_root(cfg.distributed))
    job = RewardModelJob(cfg=rm_cfg, rows=write_frame(pairs, out / "inputs", "rows"), source=cfg.preferences.source,
                         heldout=write_frame(heldout, out / "inputs", "heldout") if heldout is not None else None,
                         output_dir=str(out), distributed=cfg.distributed)
    metrics = tracking.MetricsLogger(run_id)
    report = launch.run_launched(job, metrics, ray_address=ray_address) if launched else run(job, metrics)
    result = RewardModelResult(**{**report, "model_dir": Path(report["model_dir"])})
    tracking.MetricsLogger(run_id)(result.steps, {**result.heldout_metrics,
                                                  "rm/heldout_accuracy_before": result.heldout_accuracy_before})
    get_run_logger().info("reward model: held-out pair accuracy %.3f (untrained %.3f)", result.heldout_accuracy,
                          result.heldout_accuracy_before)
    return tracking.log_dir(run_id, result.model_dir, "reward_model")


@task(name="train_dpo_model")
def train_dpo_model(run_id: str, stage: str, model_cfg: ModelConfig, checkpoint_uri: str,
                    cfg: AlignmentGRPOConfig) -> str:
    """DPO from the checkpoint on the stage's preference pairs (`algorithm: dpo`); log its figures; return the new
    checkpoint's URI."""
    pairs, heldout = load_preference_data(cfg.preferences)  # a bad file fails here, in one line, before any model
    launch.check_splits(cfg.distributed, dpo__batch_size=cfg.dpo.batch_size)
    ray_address = cluster.check_training_cluster(cfg.distributed, stage)  # None: this machine's processes
    tracking.log_dataset(run_id, pairs.astype(str), name="preferences", source=cfg.preferences.source, context="dpo")
    dpo_cfg = resolve_precision(run_id, "dpo", cfg.dpo)
    # keyed by what determines the result, so rerunning an interrupted stage resumes from its last checkpoint
    out = work_dir(run_id, stage, checkpoint_uri, model_cfg, cfg.preferences, dpo_cfg,
                   *launch.resume_key(cfg.distributed), root=launch.work_root(cfg.distributed))
    with durable_resume(run_id, out) as step:  # its newest checkpoint, wherever it ran before; copies of new ones
        if step:
            get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
        progress = TrainingProgress(run_id, stage, dpo_cfg.max_steps)  # MLflow metrics and the Prefect progress
        model_cfg = resolve_model(model_cfg, checkpoint_uri)
        job = DPOJob(model=model_cfg, cfg=dpo_cfg, rows=write_frame(pairs, out / "inputs", "rows"),
                     heldout=write_frame(heldout, out / "inputs", "heldout") if heldout is not None else None,
                     source=cfg.preferences.source, output_dir=str(out), distributed=cfg.distributed)
        if launch.is_launched(cfg.distributed):
            report = launch.run_launched(job, progress, ray_address=ray_address)
        else:
            report = run(job, progress)
        model_dir, steps, heldout_metrics = Path(report["model_dir"]), report["steps"], report["heldout_metrics"]
    get_run_logger().info("DPO finished: %d steps, held-out pair accuracy %.3f", steps,
                          heldout_metrics["dpo/heldout_accuracy"])
    return tracking.log_dir(run_id, model_dir, "checkpoint")


@task(name="evaluate_refusals")
def evaluate_refusals(run_id: str, checkpoint_uri: str, cfg: AlignmentGRPOConfig, step: int = 0) -> dict[str, float]:
    """The checkpoint's refusal figures on the preferences' held-out synthetic general prompts (every alignment
    algorithm logs them): alignment/harmful_refused and alignment/harmless_answered, and a table of the answers."""
    import torch

    from grpo.evaluate import evaluate_refusals as measure
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.engines import build_engine

    prompts = general_prompts(cfg.refusal_prompts, split="heldout", heldout_percent=cfg.preferences.heldout_percent)
    model, tokenizer = load_model_and_tokenizer(resolve_model(cfg.model, checkpoint_uri))
    if torch.cuda.is_available():
        model = model.cuda()
    engine = build_engine(cfg.generation, model, tokenizer, who="refusal evaluation")
    result = measure(engine, prompts, cfg.eval)
    tracking.MetricsLogger(run_id)(step, result.metrics)
    tracking.log_table(run_id, result.samples, f"alignment/refusals_step_{step}.json")
    get_run_logger().info("refusals at step %d: harmful requests refused %.3f, harmless ones answered %.3f", step,
                          result.metrics["alignment/harmful_refused"], result.metrics["alignment/harmless_answered"])
    return result.metrics
