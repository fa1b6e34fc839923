"""Task: GRPO from a checkpoint (reasoning RL, and alignment RL)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from grpo.config import GRPOConfig, ModelConfig
from pathlib import Path

from grpo.models import load_model_and_tokenizer
from grpo.recipe import DistributedConfig
from grpo.rewards import REWARD_FUNCTIONS
from grpo.training.grpo_trainer import GRPOTrainer
from grpo.training.reward_model import RewardModelScorer, reward_model_reward
from tasks import launch, tracking
from tasks.data import read_frame
from tasks.progress import TrainingProgress
from tasks.stage import log_precision, note_resume, resolve_model, work_dir


@task(name="train_grpo_model")
def train_grpo_model(run_id: str, stage: str, model_cfg: ModelConfig, checkpoint_uri: str, train_uri: str,
                     cfg: GRPOConfig, reward_model_uri: str | None = None,
                     distributed: DistributedConfig = DistributedConfig()) -> str:
    """Run GRPO from the checkpoint on the training prompts; log metrics and sample tables; return the new checkpoint.

    With `reward_model_uri`, the reward named "reward_model" is that model's score (on rows of kind "general").
    """
    rows = read_frame(train_uri)
    processes = launch.check_splits(distributed, grpo__prompts_per_step=cfg.prompts_per_step)
    launched = launch.is_launched(distributed)
    out = work_dir(run_id, stage, checkpoint_uri, model_cfg, cfg, rows["prompt"].astype(str).tolist(),
                   reward_model_uri, *([distributed] if launched else []))

    def log_samples(step, table):
        tracking.log_table(run_id, table, f"samples/step_{step:05d}.json")

    log_precision(run_id, "grpo", cfg.mixed_precision)
    if step := note_resume(run_id, out):
        get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
    progress = TrainingProgress(run_id, stage, cfg.max_steps)  # MLflow metrics and the Prefect progress artifact
    model_cfg = resolve_model(model_cfg, checkpoint_uri)
    reward_model_dir = tracking.download(reward_model_uri) if reward_model_uri else None
    if launched:
        get_run_logger().info("training on %d processes (accelerate launch)", processes)
        report = launch.run_launched("grpo", out, distributed, {
            "model": model_cfg.model_dump(mode="json"), "cfg": cfg.model_dump(mode="json"),
            "reward_model": str(reward_model_dir) if reward_model_dir else None}, progress, log_samples,
            frames={"rows": rows})
        model_dir, steps = Path(report["model_dir"]), report["steps"]
    else:
        reward_functions = None
        if reward_model_dir:
            scorer = RewardModelScorer.from_pretrained(reward_model_dir)
            reward_functions = {**REWARD_FUNCTIONS, "reward_model": reward_model_reward(scorer)}
        model, tokenizer = load_model_and_tokenizer(model_cfg)
        trainer = GRPOTrainer(model, tokenizer, rows, cfg, out, on_metrics=progress, on_samples=log_samples,
                              reward_functions=reward_functions)
        model_dir, steps = trainer.train()
    get_run_logger().info("GRPO finished: %d steps", steps)
    return tracking.log_dir(run_id, model_dir, "checkpoint")
