"""Task: GRPO from a checkpoint (reasoning RL, and alignment RL), or PPO with a critic in its place."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger

from grpo.config import GenerationConfig, GRPOConfig, ModelConfig
from grpo.ppo_config import PPOConfig
from grpo.recipe import DistributedConfig
from grpo.training import launch
from grpo.training.worker import build_rl_trainer
from tasks import cluster, tracking
from tasks.data import read_frame
from tasks.progress import TrainingProgress
from tasks.durable import durable_resume
from tasks.stage import resolve_model, resolve_precision, work_dir


@task(name="train_grpo_model")
def train_grpo_model(run_id: str, stage: str, model_cfg: ModelConfig, checkpoint_uri: str, train_uri: str,
                     cfg: GRPOConfig, reward_model_uri: str | None = None, ppo: PPOConfig | None = None,
                     distributed: DistributedConfig = DistributedConfig(),
                     generation: GenerationConfig = GenerationConfig()) -> str:
    """Run GRPO from the checkpoint on the training prompts; log metrics and sample tables; return the new checkpoint.
    Rollouts come from the engine `generation` names (the stage's section).

    With `reward_model_uri`, the reward named "reward_model" is that model's score (on rows of kind "general").
    With `ppo`, PPO with a critic runs instead, on the same rewards, sampling and optimiser settings.
    """
    rows = read_frame(train_uri)
    processes = launch.check_splits(distributed, grpo__prompts_per_step=cfg.prompts_per_step)
    ray_address = cluster.check_training_cluster(distributed, stage)  # None: this machine's processes
    launched = launch.is_launched(distributed)
    if launched and ppo is not None:
        raise ValueError("algorithm ppo trains in one process: set distributed.num_processes to 1")
    cfg = resolve_precision(run_id, "grpo", cfg)
    out = work_dir(run_id, stage, checkpoint_uri, model_cfg, cfg, rows["prompt"].astype(str).tolist(),
                   reward_model_uri, *([ppo] if ppo else []),  # a PPO run never resumes a GRPO run's work
                   *launch.resume_key(distributed), root=launch.work_root(distributed))

    def log_samples(step, table):
        tracking.log_table(run_id, table, f"samples/step_{step:05d}.json")

    with durable_resume(run_id, out) as step:  # its newest checkpoint, wherever it ran before; copies of new ones
        if step:
            get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
        progress = TrainingProgress(run_id, stage, cfg.max_steps)  # MLflow metrics and the Prefect progress artifact
        model_cfg = resolve_model(model_cfg, checkpoint_uri)
        reward_model_dir = str(tracking.download(reward_model_uri)) if reward_model_uri else None
        prm_dir = str(tracking.download(cfg.prm_path)) if cfg.step_verifier == "prm" else None  # process reward model
        if launched:
            get_run_logger().info("training on %d processes (%s)", processes,
                                  "Ray Train" if ray_address else "accelerate launch")
            report = launch.run_launched("grpo", out, distributed, {
                "model": model_cfg.model_dump(mode="json"), "cfg": cfg.model_dump(mode="json"),
                "reward_model": reward_model_dir, "prm": prm_dir, "generation": generation.model_dump(mode="json")},
                progress, log_samples, frames={"rows": rows}, ray_address=ray_address)
            model_dir, steps = Path(report["model_dir"]), report["steps"]
        else:
            trainer = build_rl_trainer(model_cfg, rows, cfg, out, reward_model=reward_model_dir, prm=prm_dir, ppo=ppo,
                                       generation=generation, on_metrics=progress, on_samples=log_samples,
                                       distributed=distributed)
            model_dir, steps = trainer.train()
    get_run_logger().info("%s finished: %d steps", "GRPO" if ppo is None else "PPO", steps)
    return tracking.log_dir(run_id, model_dir, "checkpoint")
