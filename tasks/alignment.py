"""Tasks of the alignment stage: the reward model and the mixed prompt set (registering the final model and
promoting it: `tasks.promotion`)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from grpo.recipe import AlignmentGRPOConfig
from grpo.data.tables import load_rl_data, read_table, validate_rows
from grpo.data.preferences import alignment_prompts, general_prompts, load_preference_data
from grpo.training.reward_model import RewardModelResult, train_reward_model
from grpo.training import launch
from tasks import cluster, tracking
from tasks.data import DataURIs, report_dropped
from tasks.stage import resolve_precision, work_dir


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
    if launched:
        frames = {"rows": pairs, **({"heldout": heldout} if heldout is not None else {})}
        report = launch.run_launched("reward_model", out, cfg.distributed,
                                     {"cfg": rm_cfg.model_dump(mode="json"), "source": cfg.preferences.source},
                                     tracking.MetricsLogger(run_id), frames=frames, ray_address=ray_address)
        result = RewardModelResult(**{**report, "model_dir": Path(report["model_dir"])})
    else:
        result = train_reward_model(pairs, rm_cfg, out, on_metrics=tracking.MetricsLogger(run_id),
                                    heldout=heldout, source=cfg.preferences.source, distributed=cfg.distributed)
    tracking.MetricsLogger(run_id)(result.steps, {**result.heldout_metrics,
                                                  "rm/heldout_accuracy_before": result.heldout_accuracy_before})
    get_run_logger().info("reward model: held-out pair accuracy %.3f (untrained %.3f)", result.heldout_accuracy,
                          result.heldout_accuracy_before)
    return tracking.log_dir(run_id, result.model_dir, "reward_model")
