"""What each process of a launched training stage runs: one training loop, read from a job file.

    accelerate launch --num_processes N -m grpo.training.launchers.worker <work folder>/launch/job.json

The stage task (`grpo.training.launchers.launch`) writes the job file with every input already a local file (rows as Parquet, the
model as a folder or the tiny config), starts this module under `accelerate launch`, and logs what the main process
reports. Only the main process (rank 0) reports, through the loops' callbacks: it appends metrics and sample
tables as JSON lines to the job's events file, and writes `result.json` when the loop has finished. Imports
neither Prefect nor MLflow: the task that launched it is the only process that talks to them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd


class EventWriter:
    """The loops' `on_metrics` and `on_samples` callbacks: one JSON line each, appended to the events file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _write(self, event: dict) -> None:
        with self.path.open("a") as f:  # one write per line, flushed on close: the task reads whole lines only
            f.write(json.dumps(event) + "\n")

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._write({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}})

    def samples(self, step: int, table: pd.DataFrame) -> None:
        self._write({"step": step, "samples": json.loads(table.to_json(orient="split", index=False))})


def _sft(job: dict, events: EventWriter) -> dict:
    from grpo.config import ModelConfig, SFTConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft

    model, tokenizer = load_model_and_tokenizer(ModelConfig.model_validate(job["model"]))
    result = train_sft(model, tokenizer, pd.read_parquet(job["rows"]), SFTConfig.model_validate(job["cfg"]),
                       job["output_dir"], events.metrics, source=job["source"], distributed=_distributed(job))
    return {"model_dir": str(result.model_dir), "steps": result.steps, "final_loss": result.final_loss}


def _distributed(job: dict):
    from grpo.distributed_config import DistributedConfig

    return DistributedConfig.model_validate(job.get("distributed") or {})


def build_rl_trainer(model_cfg, rows: pd.DataFrame, cfg, output_dir, *, reward_model: str | None = None,
                     prm: str | None = None, ppo=None, generation=None, on_metrics=None, on_samples=None,
                     distributed=None, refresh=None, online_rft=None):
    """The GRPO (or, with `ppo`, PPO) trainer of a stage, from local inputs only: the stage task's own process and
    each launched process build it the same way.

    `reward_model` and `prm` are local folders: the alignment stage's reward model (the "reward_model" reward) and
    the process reward model that scores steps (`step_verifier: prm`). `generation`: the stage's engine section.
    `distributed`: the stage's section (its strategy decides how the processes hold the policy). `refresh`: the
    iterative reward model, (its RewardModelConfig, the original preference pairs, held-out pairs or None).
    `online_rft`: its settings (an OnlineRFTConfig) when the stage runs online RFT, GRPO's loop with a coefficient a
    sample.
    """
    from grpo.models import load_model_and_tokenizer
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.reward_scorer import RewardModelScorer, reward_model_reward

    reward_functions, hooks = None, []
    if reward_model:
        scorer = RewardModelScorer.from_pretrained(reward_model)
        reward_functions = {**REWARD_FUNCTIONS, "reward_model": reward_model_reward(scorer)}
        if refresh is not None:  # the scorer GRPO reads, trained further on the policy's samples
            from grpo.training.loops.rm_refresh import RewardModelRefresh

            rm_cfg, replay, heldout = refresh
            hooks.append(RewardModelRefresh(scorer, rm_cfg, cfg.rewards, cfg.num_generations, replay=replay,
                                            heldout=heldout))
    model, tokenizer = load_model_and_tokenizer(model_cfg)
    kwargs = dict(on_metrics=on_metrics, on_samples=on_samples, reward_functions=reward_functions,
                  generation=generation, distributed=distributed)
    if ppo is not None:
        from grpo.training.loops.ppo_trainer import PPOTrainer

        return PPOTrainer(model, tokenizer, rows, cfg, output_dir, ppo=ppo, **kwargs)
    step_verifiers = None
    if prm:
        from grpo.training.loops.prm import prm_step_verifier

        step_verifiers = {"prm": prm_step_verifier(prm)}
    coefficients = None
    if online_rft is not None:
        from grpo.rft_config import check_rft_settings
        from grpo.training.rft import coefficient_function

        check_rft_settings(cfg, online_rft)  # the recipe checked it; a caller of its own may not have
        coefficients = coefficient_function(online_rft)
    frozen = None
    if online_rft is not None and online_rft.sampler == "initial":  # offline RFT: the start samples every step
        import copy

        frozen = copy.deepcopy(model).eval().requires_grad_(False)
    trainer = GRPOTrainer(model, tokenizer, rows, cfg, output_dir, step_verifiers=step_verifiers, hooks=hooks,
                          coefficients=coefficients, **kwargs)
    if frozen is not None:
        from grpo.config import GenerationConfig
        from grpo.sampling.engines import build_engine, sampling_dtype

        trainer.engine = build_engine(generation or GenerationConfig(), frozen.to(trainer.acc.device), tokenizer,
                                      dtype=sampling_dtype(trainer.acc.mixed_precision), who="offline RFT")
    return trainer


def _grpo(job: dict, events: EventWriter) -> dict:
    from grpo.config import GenerationConfig, GRPOConfig, ModelConfig
    from grpo.ppo_config import PPOConfig
    from grpo.rft_config import OnlineRFTConfig

    ppo = PPOConfig.model_validate(job["ppo"]) if job.get("ppo") else None  # PPO with a critic instead
    refresh = None
    if job.get("refresh"):  # the iterative reward model: its settings, the original pairs, the held-out ones
        from grpo.reward_config import RewardModelConfig

        refresh = (RewardModelConfig.model_validate(job["refresh"]), pd.read_parquet(job["refresh_pairs"]),
                   pd.read_parquet(job["refresh_heldout"]) if job.get("refresh_heldout") else None)
    online_rft = OnlineRFTConfig.model_validate(job["online_rft"]) if job.get("online_rft") else None
    trainer = build_rl_trainer(ModelConfig.model_validate(job["model"]), pd.read_parquet(job["rows"]),
                               GRPOConfig.model_validate(job["cfg"]), job["output_dir"],
                               reward_model=job.get("reward_model"), prm=job.get("prm"), ppo=ppo, refresh=refresh,
                               generation=GenerationConfig.model_validate(job.get("generation") or {}),
                               on_metrics=events.metrics, on_samples=events.samples, distributed=_distributed(job),
                               online_rft=online_rft)
    result = trainer.train()
    return {"model_dir": str(result.model_dir), "steps": result.steps}


def _reward_model(job: dict, events: EventWriter) -> dict:
    from grpo.reward_config import RewardModelConfig
    from grpo.training.loops.reward_model import train_reward_model

    heldout = pd.read_parquet(job["heldout"]) if job.get("heldout") else None
    result = train_reward_model(pd.read_parquet(job["rows"]), RewardModelConfig.model_validate(job["cfg"]),
                                job["output_dir"], events.metrics, heldout=heldout, source=job["source"],
                                distributed=_distributed(job))
    return {**result._asdict(), "model_dir": str(result.model_dir)}


def _dpo(job: dict, events: EventWriter) -> dict:
    from grpo.config import ModelConfig
    from grpo.dpo_config import DPOConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.dpo import train_dpo

    model, tokenizer = load_model_and_tokenizer(ModelConfig.model_validate(job["model"]))
    heldout = pd.read_parquet(job["heldout"]) if job.get("heldout") else None
    result = train_dpo(model, tokenizer, pd.read_parquet(job["rows"]), DPOConfig.model_validate(job["cfg"]),
                       job["output_dir"], events.metrics, heldout=heldout, source=job["source"],
                       distributed=_distributed(job))
    return {**result._asdict(), "model_dir": str(result.model_dir)}


LOOPS = {"sft": _sft, "grpo": _grpo, "reward_model": _reward_model, "dpo": _dpo}


def run_job(job: dict) -> None:
    """Run the job's loop in this process (one of the launch's, or a Ray Train worker); rank 0 writes the result."""
    result = LOOPS[job["loop"]](job, EventWriter(job["events"]))
    if int(os.environ.get("RANK", "0")) == 0:  # the global rank; the loops have saved and synchronised
        Path(job["result"]).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print(__doc__, file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    if job.get("loop") not in LOOPS:
        raise SystemExit(f"{argv[0]}: loop must be one of {sorted(LOOPS)}, got {job.get('loop')!r}")
    run_job(job)
    from grpo.training.distributed import exit_process

    exit_process(0)  # after the whole loop, on success: a failure exits non-zero anyway


if __name__ == "__main__":
    sys.exit(main())
