"""PPO's own settings, for running the reasoning stage with PPO and a critic instead of GRPO (`algorithm: ppo`).

PPO here is InstructGPT's third step, the algorithm GRPO was made to replace: a value model as large as the
policy, GAE over the completion tokens, clipped policy and value losses. Everything the two share (rewards,
sampling, learning rate, KL coefficient `beta`, clip range `epsilon`, steps, micro-batches, precision) stays in the
stage's `grpo` section, so a recipe switches algorithm with one line and the rest of the run is the same.

Plain pydantic: must not import torch (a recipe is checked without it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from grpo.configs.training import GRPOConfig

ALGORITHMS = ("grpo", "ppo")  # what the reasoning stage may run


class PPOConfig(BaseModel):
    """PPO with a separate value model (names follow TRL's PPOConfig where they mean the same thing)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gamma: float = Field(1.0, ge=0, le=1)  # discount over completion tokens (1: the final reward counts in full)
    lam: float = Field(0.95, ge=0, le=1)  # GAE's lambda: 1 = Monte-Carlo returns, 0 = one-step TD
    cliprange_value: float = Field(0.2, gt=0)  # the new value may move this far from the rollout's value, unclipped
    vf_coef: float = Field(0.1, ge=0)  # weight of the value loss beside the policy loss (TRL's default)
    # where grpo.loss.beta's KL goes: "reward" (InstructGPT, TRL, OpenRLHF: -beta x (logp - ref) on every token's
    # reward, the critic learns it) or "loss" (GRPO's k3 term in the loss, as the GRPO paper does instead)
    kl_in: Literal["reward", "loss"] = "reward"
    value_learning_rate: float | None = Field(None, gt=0)  # the critic's AdamW rate; None = grpo.optimizer's


def check_ppo_settings(grpo: GRPOConfig, prompts: int | None, source: str = "the data section") -> None:
    """Raise on GRPO settings PPO cannot honour, and when the training set cannot fill one PPO step.

    At equal budget PPO samples one completion for each of prompts_per_step x num_generations prompts: as many
    completions a step as GRPO, each of its own prompt.
    """
    if grpo.rollout.dynamic_sampling:
        raise ValueError("algorithm ppo has no groups to filter: set grpo.rollout.dynamic_sampling to false")
    if grpo.loss.importance_sampling_level != "token":
        raise ValueError("algorithm ppo has an advantage per token: set grpo.loss.importance_sampling_level to 'token'")
    if grpo.lora is not None:
        raise ValueError("algorithm ppo trains the whole policy and critic: remove grpo.lora")
    if grpo.prompt_mix:
        raise ValueError("algorithm ppo draws its prompts from all rows alike: remove grpo.prompt_mix")
    if grpo.schedule != type(grpo.schedule)():
        raise ValueError("algorithm ppo counts every reward from the first step against a fixed reference: remove "
                         "grpo.schedule")
    need = grpo.prompts_per_step * grpo.num_generations
    if prompts is not None and prompts < need:
        raise ValueError(f"algorithm ppo samples one completion for each of grpo.prompts_per_step x "
                         f"grpo.num_generations = {grpo.prompts_per_step} x {grpo.num_generations} = {need} prompts "
                         f"a step, more than the {prompts} training prompts {source} gives; lower them or give more "
                         f"prompts (data.num_train)")
