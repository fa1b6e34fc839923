"""The parts a GRPO loop is handed, built from a stage's config: the policy runtime (grpo.training.runtime), the
rollout source (grpo.training.sources) and the advantage function (grpo.training.credit). The job runner builds them
(grpo.training.jobs); a caller that hands the loop none gets the same from here.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, NamedTuple

import pandas as pd
import torch

from grpo.configs.distributed import DistributedConfig
from grpo.configs.sampling import GenerationConfig
from grpo.configs.training import GRPOConfig
from grpo.rewards.steps import StepVerifier
from grpo.sampling.engines import Engine
from grpo.training.credit import AdvantageFunction, advantage_function
from grpo.training.runtime import PolicyRuntime
from grpo.training.sources import RolloutSource, rollout_source


class LoopParts(NamedTuple):
    runtime: PolicyRuntime  # the policy, its reference, accelerator, strategy, prompts and reward functions
    source: RolloutSource  # where each step's scored groups come from
    advantage: AdvantageFunction  # what each completion is credited with


def grpo_parts(model: torch.nn.Module, tokenizer, prompts: pd.DataFrame, cfg: GRPOConfig, output_dir: str | Path, *,
               engine: Engine | None = None, generation: GenerationConfig | None = None,
               reward_functions: Mapping[str, Callable] | None = None,
               step_verifiers: Mapping[str, StepVerifier] | None = None, distributed: DistributedConfig | None = None,
               coefficients: Callable[[object], torch.Tensor] | None = None) -> LoopParts:
    """A GRPO run's parts: its advantage first (a step verifier that is not there fails before any model work), then
    the runtime, then the rollout source on it (`engine`, else the stage's; asynchronous samplers as `rollout` asks)."""
    advantage = advantage_function(cfg, tokenizer, prompts, step_verifiers, coefficients)
    runtime = PolicyRuntime(model, tokenizer, prompts, cfg, output_dir, who="GRPO", reward_functions=reward_functions,
                            distributed=distributed)
    return LoopParts(runtime, rollout_source(runtime, generation, engine), advantage)
