"""Task: GRPO from a checkpoint (reasoning RL, and alignment RL), or PPO with a critic in its place."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from grpo.config import GRPOConfig, ModelConfig
from grpo.models import load_model_and_tokenizer
from grpo.ppo_config import PPOConfig
from grpo.rewards import REWARD_FUNCTIONS
from grpo.training.grpo_trainer import GRPOTrainer
from grpo.training.ppo_trainer import PPOTrainer
from grpo.training.prm import prm_step_verifier
from grpo.training.reward_model import RewardModelScorer, reward_model_reward
from tasks import tracking
from tasks.data import read_frame
from tasks.progress import TrainingProgress
from tasks.stage import log_precision, note_resume, resolve_model, work_dir


@task(name="train_grpo_model")
def train_grpo_model(run_id: str, stage: str, model_cfg: ModelConfig, checkpoint_uri: str, train_uri: str,
                     cfg: GRPOConfig, reward_model_uri: str | None = None, ppo: PPOConfig | None = None) -> str:
    """Run GRPO from the checkpoint on the training prompts; log metrics and sample tables; return the new checkpoint.

    With `reward_model_uri`, the reward named "reward_model" is that model's score (on rows of kind "general").
    With `ppo`, PPO with a critic runs instead, on the same rewards, sampling and optimiser settings.
    """
    rows = read_frame(train_uri)
    reward_functions = None
    if reward_model_uri:
        scorer = RewardModelScorer.from_pretrained(tracking.download(reward_model_uri))
        reward_functions = {**REWARD_FUNCTIONS, "reward_model": reward_model_reward(scorer)}
    step_verifiers = None
    if cfg.step_verifier == "prm":  # process supervision by a trained process reward model
        step_verifiers = {"prm": prm_step_verifier(tracking.download(cfg.prm_path))}
    model, tokenizer = load_model_and_tokenizer(resolve_model(model_cfg, checkpoint_uri))
    out = work_dir(run_id, stage, checkpoint_uri, model_cfg, cfg, rows["prompt"].astype(str).tolist(),
                   reward_model_uri, *([ppo] if ppo else []))  # a PPO run never resumes a GRPO run's work

    def log_samples(step, table):
        tracking.log_table(run_id, table, f"samples/step_{step:05d}.json")

    log_precision(run_id, "grpo", cfg.mixed_precision)
    if step := note_resume(run_id, out):
        get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
    progress = TrainingProgress(run_id, stage, cfg.max_steps)  # MLflow metrics and the Prefect progress artifact
    kwargs = dict(on_metrics=progress, on_samples=log_samples, reward_functions=reward_functions)
    if ppo is None:
        trainer = GRPOTrainer(model, tokenizer, rows, cfg, out, step_verifiers=step_verifiers, **kwargs)
    else:
        trainer = PPOTrainer(model, tokenizer, rows, cfg, out, ppo=ppo, **kwargs)
    result = trainer.train()
    get_run_logger().info("%s finished: %d steps", "GRPO" if ppo is None else "PPO", result.steps)
    return tracking.log_dir(run_id, result.model_dir, "checkpoint")
