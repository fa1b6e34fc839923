"""Task: GRPO from a checkpoint (reasoning RL, and alignment RL), or PPO with a critic or online RFT in its place."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.alignment import AlignmentWatchConfig
from grpo.configs.distributed import DistributedConfig
from grpo.configs.model import ModelConfig
from grpo.configs.ppo import PPOConfig
from grpo.configs.reward import PreferenceDataConfig, RewardModelConfig
from grpo.configs.rft import OnlineRFTConfig
from grpo.configs.sampling import GenerationConfig
from grpo.configs.training import GRPOConfig
from grpo.training.launchers import launch
from grpo.training.jobs import GRPOJob, run, write_frame
from runtime import cluster, tracking
from runtime.durable import durable_resume
from runtime.progress import TrainingProgress
from runtime.stage import log_gemm_plan, resolve_model, resolve_precision, work_dir


@task(name="train_grpo_model")
def train_grpo_model(run_id: str, stage: str, model_cfg: ModelConfig, checkpoint_uri: str, train_uri: str,
                     cfg: GRPOConfig, reward_models: dict[str, str] | None = None, ppo: PPOConfig | None = None,
                     distributed: DistributedConfig = DistributedConfig(),
                     generation: GenerationConfig = GenerationConfig(),
                     refresh: RewardModelConfig | None = None,
                     preferences: PreferenceDataConfig | None = None,
                     online_rft: OnlineRFTConfig | None = None,
                     watch: AlignmentWatchConfig | None = None, helpfulness_reads: str = "answer") -> str:
    """Run GRPO from the checkpoint on the training prompts; log metrics and sample tables; return the new checkpoint.
    Rollouts come from the engine `generation` names (the stage's section).

    With `reward_models` (reward name -> URI), the rewards of those names are those models' scores on rows of kind
    "general" (grpo.training.reward_scorer.ROUTES: which categories each scores, and what it reads).
    With `watch`, the general rows' true score is logged beside the reward models' (grpo.training.alignment_watch).
    With `ppo`, PPO with a critic runs instead, on the same rewards, sampling and optimiser settings.
    With `refresh` (the stage's reward_model section, `refresh_every` set), that reward model is trained further on
    the policy's samples as GRPO runs, replaying the `preferences` pairs (grpo.training.loops.rm_refresh).
    With `online_rft`, GRPO's loop trains each sample with coefficient 1 when correct and 0 otherwise.
    """
    rows_path = str(tracking.download(train_uri))  # Parquet
    rows = pd.read_parquet(rows_path)
    refresh_frames = {}
    if refresh is not None:  # read (and checked) before any model loads
        from grpo.data.preferences import load_preference_data, split_by_prompt

        pairs, heldout = load_preference_data(preferences) if preferences is not None else (None, None)
        if pairs is not None and heldout is None and refresh.eval_fraction > 0:  # as the reward model's training does
            pairs, heldout = split_by_prompt(pairs, refresh.eval_fraction)
        refresh_frames = {k: v for k, v in (("refresh_pairs", pairs), ("refresh_heldout", heldout)) if v is not None}
    processes = launch.check_splits(distributed, grpo__prompts_per_step=cfg.prompts_per_step)
    ray_address = cluster.check_training_cluster(distributed, stage)  # None: this machine's processes
    cfg = cluster.check_rollout_cluster(cfg, distributed, stage)  # its samplers' cluster, where they are Ray actors
    launched = launch.is_launched(distributed)
    cfg = resolve_precision(run_id, "grpo", cfg)
    out = work_dir(run_id, stage, checkpoint_uri, model_cfg, cfg, rows["prompt"].astype(str).tolist(),
                   reward_models or None, *([ppo] if ppo else []),  # a PPO run never resumes a GRPO run's work
                   *([refresh, preferences] if refresh else []),  # nor one with the reward model refreshed
                   *([online_rft] if online_rft else []),  # nor an online RFT run
                   *launch.resume_key(distributed), root=launch.work_root(distributed))

    def log_samples(step, table):
        tracking.log_table(run_id, table, f"samples/step_{step:05d}.json")

    with durable_resume(run_id, out) as step:  # its newest checkpoint, wherever it ran before; copies of new ones
        if step:
            get_run_logger().info("resuming from the checkpoint at step %d in %s", step, out)
        progress = TrainingProgress(run_id, stage, cfg.max_steps)  # MLflow metrics and the Prefect progress artifact
        model_cfg = resolve_model(model_cfg, checkpoint_uri)
        reward_model_dirs = {name: str(tracking.download(uri)) for name, uri in (reward_models or {}).items()}
        # the process reward model
        prm_dir = str(tracking.download(cfg.grading.prm_path)) if cfg.grading.step_verifier == "prm" else None
        job = GRPOJob(model=model_cfg, cfg=cfg, rows=rows_path, output_dir=str(out), generation=generation,
                      reward_models=reward_model_dirs, prm=prm_dir, ppo=ppo, online_rft=online_rft, refresh=refresh,
                      watch=watch, helpfulness_reads=helpfulness_reads,
                      distributed=distributed, **{name: write_frame(frame, out / "inputs", name)
                                                  for name, frame in refresh_frames.items()})
        if launched:
            get_run_logger().info("training on %d processes (%s)", processes,
                                  "Ray Train" if ray_address else "accelerate launch")
            report = launch.run_launched(job, progress, log_samples, ray_address=ray_address)
        else:
            report = run(job, progress, log_samples)
        model_dir, steps = Path(report["model_dir"]), report["steps"]
    get_run_logger().info("%s finished: %d steps", "PPO" if ppo else "online RFT" if online_rft else "GRPO", steps)
    log_gemm_plan(run_id, "grpo", out)
    refreshed = out / "reward_model"  # the iterative reward model as the run left it (grpo.training.loops.rm_refresh)
    if refresh is not None and refreshed.is_dir():
        tracking.log_dir(run_id, refreshed, "reward_model_refreshed")
    return tracking.log_dir(run_id, model_dir, "checkpoint")
