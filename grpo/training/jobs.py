"""One typed job per training loop: what a stage task builds once, and what runs it wherever it runs.

A stage's task resolves its inputs to local files and builds one frozen job (`SFTJob`, `GRPOJob`, `RewardModelJob`,
`DPOJob`: the loop's settings and the paths it reads and writes). `run(job, on_metrics, on_samples)` builds the
loop's model, engine and reference from it and trains, in the task's own process, or in each process of an
`accelerate launch`, a machine of a multi-pod job or a Ray Train worker: a launcher writes the job as one JSON
document (`Launched`, with where to report) and the worker validates it back with `read_launched`, so a setting
added to a job reaches every launcher without being written anywhere else. Launchers only launch.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated, Callable, ClassVar, Literal, Union

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from grpo.configs.alignment import AlignmentWatchConfig
from grpo.configs.distributed import DistributedConfig
from grpo.configs.dpo import DPOConfig
from grpo.configs.model import ModelConfig
from grpo.configs.ppo import PPOConfig
from grpo.configs.reward import RewardModelConfig
from grpo.configs.rft import OnlineRFTConfig
from grpo.configs.sampling import GenerationConfig
from grpo.configs.training import GRPOConfig, SFTConfig

MetricsCallback = Callable[[int, dict[str, float]], None]
SamplesCallback = Callable[[int, pd.DataFrame], None]


class _Job(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    output_dir: str  # the stage's work folder: checkpoints, the final model
    distributed: DistributedConfig = DistributedConfig()  # how its processes hold the model

    # the fields that name input files (Parquet, or lists of them): a launch copies them where every process reads them
    INPUTS: ClassVar[tuple[str, ...]] = ()
    # the modules its loop imports (`load_libraries`: a launched process loads them before anything else)
    LIBRARIES: ClassVar[tuple[str, ...]] = ()


class SFTJob(_Job):
    loop: Literal["sft"] = "sft"
    model: ModelConfig
    cfg: SFTConfig
    rows: list[str]  # Parquet files or folders of them, of (prompt, response): one table, in this order
    source: str  # where the rows came from, named in errors about them
    INPUTS = ("rows",)
    LIBRARIES = ("grpo.models", "grpo.training.loops.sft_trainer")


class GRPOJob(_Job):
    """GRPO, or PPO with a critic (`ppo`), or online/offline RFT (`online_rft`), from a checkpoint on prompts."""

    loop: Literal["grpo"] = "grpo"
    model: ModelConfig
    cfg: GRPOConfig
    rows: str  # Parquet of (prompt, answer, ...)
    generation: GenerationConfig = GenerationConfig()  # the stage's engine
    # local folders by reward name: the reward models of the alignment stage (reward_model, helpfulness, harmlessness)
    reward_models: dict[str, str] = {}
    prm: str | None = None  # a local folder: the process reward model (`step_verifier: prm`)
    ppo: PPOConfig | None = None
    online_rft: OnlineRFTConfig | None = None
    refresh: RewardModelConfig | None = None  # the iterative reward model, trained on as GRPO runs
    refresh_pairs: str | None = None  # Parquet: the original preference pairs it replays
    refresh_heldout: str | None = None  # Parquet: held-out pairs it is scored on
    watch: AlignmentWatchConfig | None = None  # the general rows' true score beside the reward models' (alignment)
    helpfulness_reads: Literal["answer", "response"] = "answer"  # what the helpfulness reward model reads
    INPUTS = ("rows", "refresh_pairs", "refresh_heldout")
    LIBRARIES = ("grpo.models", "grpo.rewards", "grpo.training.reward_scorer", "grpo.training.loops.grpo_trainer",
                 "grpo.training.loops.ppo_trainer")


class RewardModelJob(_Job):
    loop: Literal["reward_model"] = "reward_model"
    cfg: RewardModelConfig
    rows: str  # Parquet of preference pairs
    heldout: str | None = None
    source: str
    INPUTS = ("rows", "heldout")
    LIBRARIES = ("grpo.training.loops.reward_model",)


class DPOJob(_Job):
    loop: Literal["dpo"] = "dpo"
    model: ModelConfig
    cfg: DPOConfig
    rows: str
    heldout: str | None = None
    source: str
    INPUTS = ("rows", "heldout")
    LIBRARIES = ("grpo.models", "grpo.training.loops.dpo")


Job = Annotated[Union[SFTJob, GRPOJob, RewardModelJob, DPOJob], Field(discriminator="loop")]


class Launched(BaseModel):
    """The one document a launcher hands each process: the job, and where its main process reports."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: Job
    events: str  # JSON lines: metrics and sample tables, appended by the main process
    result: str  # the report, written by the main process when the loop has finished


_LAUNCHED = TypeAdapter(Launched)


def read_launched(text: str) -> Launched:
    """A launch file's document, checked field by field (a wrong one names its field)."""
    return _LAUNCHED.validate_json(text)


def load_libraries(job: SFTJob | GRPOJob | RewardModelJob | DPOJob) -> None:
    """Import what the job's loop needs, so that a launched process loads it all before building anything
    (grpo.startup: without the cyclic collector)."""
    for name in job.LIBRARIES:
        importlib.import_module(name)


def write_frame(frame: pd.DataFrame, folder: Path, name: str) -> str:
    """A table a job reads, written as Parquet under `folder`; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.parquet"
    frame.to_parquet(path)
    return str(path)


def _frame(path: str | None) -> pd.DataFrame | None:
    return pd.read_parquet(path) if path else None


def run(job: SFTJob | GRPOJob | RewardModelJob | DPOJob, on_metrics: MetricsCallback | None = None,
        on_samples: SamplesCallback | None = None) -> dict:
    """Build the job's loop and train; what it reports (JSON-able: `model_dir`, `steps`, and the loop's figures)."""
    if isinstance(job, GRPOJob):
        result = build_rl_trainer(job, on_metrics, on_samples).train()
        return {"model_dir": str(result.model_dir), "steps": result.steps}
    from grpo.models import load_model_and_tokenizer

    if isinstance(job, SFTJob):
        from grpo.training.loops.sft_trainer import train_sft

        model, tokenizer = load_model_and_tokenizer(job.model)
        result = train_sft(model, tokenizer, job.rows, job.cfg, job.output_dir, on_metrics,
                           source=job.source, distributed=job.distributed)
    elif isinstance(job, RewardModelJob):
        from grpo.training.loops.reward_model import train_reward_model

        result = train_reward_model(pd.read_parquet(job.rows), job.cfg, job.output_dir, on_metrics,
                                    heldout=_frame(job.heldout), source=job.source, distributed=job.distributed)
    else:
        from grpo.training.loops.dpo import train_dpo

        model, tokenizer = load_model_and_tokenizer(job.model)
        result = train_dpo(model, tokenizer, pd.read_parquet(job.rows), job.cfg, job.output_dir, on_metrics,
                           heldout=_frame(job.heldout), source=job.source, distributed=job.distributed)
    return {**result._asdict(), "model_dir": str(result.model_dir)}


def build_rl_trainer(job: GRPOJob, on_metrics: MetricsCallback | None = None,
                     on_samples: SamplesCallback | None = None):
    """The GRPO (or, with `ppo`, PPO) trainer of a stage, from its job: the policy, its rewards (the reward model's
    score where there is one, refreshed as GRPO runs with `refresh`), the process reward model, online RFT's
    coefficients, and for offline RFT the frozen start's engine it samples from."""
    from grpo.models import load_model_and_tokenizer
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.parts import grpo_parts
    from grpo.configs.grading import REWARD_MODEL
    from grpo.configs.reward import HELPFULNESS
    from grpo.training.reward_scorer import ROUTES, RewardModelScorer, reward_model_reward

    cfg = job.cfg
    rows = pd.read_parquet(job.rows)
    if job.online_rft is not None:
        from grpo.configs.rft import check_rft_settings

        check_rft_settings(cfg, job.online_rft)  # the recipe checked it; a job of its own may not have been
    reward_functions, hooks = None, []
    if job.reward_models:
        scorers = {name: RewardModelScorer.from_pretrained(path) for name, path in job.reward_models.items()}
        routes = {**ROUTES, HELPFULNESS: ROUTES[HELPFULNESS]._replace(answer_only=job.helpfulness_reads == "answer")}
        reward_functions = {**REWARD_FUNCTIONS, **{name: reward_model_reward(scorer, route=routes[name])
                                                   for name, scorer in scorers.items()}}
        if job.refresh is not None:  # the scorer GRPO reads, trained further on the policy's samples
            from grpo.training.loops.rm_refresh import RewardModelRefresh

            hooks.append(RewardModelRefresh(scorers[REWARD_MODEL], job.refresh, cfg.rewards, cfg.num_generations,
                                            replay=_frame(job.refresh_pairs), heldout=_frame(job.refresh_heldout)))
    if job.watch is not None and "category" in rows.columns:  # the true score needs each general row's category
        from grpo.training.alignment_watch import AlignmentWatch

        hooks.append(AlignmentWatch(rows, list(job.reward_models), cfg.num_generations, job.watch.every,
                                    job.watch.windows, job.watch.stop))
    model, tokenizer = load_model_and_tokenizer(job.model)
    kwargs = dict(on_metrics=on_metrics, on_samples=on_samples, reward_functions=reward_functions,
                  generation=job.generation, distributed=job.distributed)
    if job.ppo is not None:
        from grpo.configs.ppo import PPOTrainingConfig
        from grpo.training.loops.ppo_trainer import PPOTrainer

        # PPO's own config: the stage's grpo section's shared settings and its ppo section
        return PPOTrainer(model, tokenizer, rows, PPOTrainingConfig.from_grpo(cfg, job.ppo), job.output_dir, **kwargs)
    step_verifiers = None
    if job.prm:
        from grpo.training.loops.prm import prm_step_verifier

        step_verifiers = {"prm": prm_step_verifier(job.prm)}
    coefficients, engine = None, None
    if job.online_rft is not None:
        from grpo.training.rft import coefficient_function

        coefficients = coefficient_function(job.online_rft)
        if job.online_rft.sampler == "initial":  # offline RFT: the start samples every step
            engine = _frozen_engine(model, tokenizer, job)
    # the loop's parts: the policy runtime, the rollout source (the frozen start's engine, the stage's, or
    # asynchronous samplers) and the advantage (RFT's coefficients, process supervision's or the group outcome)
    parts = grpo_parts(model, tokenizer, rows, cfg, job.output_dir, engine=engine, generation=job.generation,
                       reward_functions=reward_functions, step_verifiers=step_verifiers, distributed=job.distributed,
                       coefficients=coefficients)
    return GRPOTrainer.from_parts(parts, on_metrics=on_metrics, on_samples=on_samples, hooks=hooks)


def _frozen_engine(model, tokenizer, job: GRPOJob):
    """Offline RFT's sampler: the stage's engine over a frozen copy of the starting model, on this process's device,
    sampling in the precision the stage trains in (as the trainer's own engine would)."""
    import copy
    import os

    import torch

    from grpo.sampling.engines import build_engine, sampling_dtype
    from grpo.training.precision import choose_precision, this_machine

    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    # the device the trainer's Accelerator gives this process: its GPU (one a process), or the CPU
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else "cpu"
    precision = choose_precision(job.cfg.memory.mixed_precision, this_machine())
    return build_engine(job.generation, frozen.to(device), tokenizer, dtype=sampling_dtype(precision),
                        who="offline RFT")
