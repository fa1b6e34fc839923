"""PPO's own settings, for running the reasoning stage with PPO and a critic instead of GRPO (`algorithm: ppo`).

PPO here is InstructGPT's third step, the algorithm GRPO was made to replace: a value model as large as the
policy, GAE over the completion tokens, clipped policy and value losses. In a recipe, everything the two share
(rewards, sampling, steps, the optimizer, loss, memory and grading sections) stays in the stage's `grpo` section and
PPO's own settings are its `ppo` section, so a recipe switches algorithm with one line and the rest of the run is the
same. The loop itself takes one config of its own, `PPOTrainingConfig`: the shared sections and `ppo`, built from
the two (`PPOTrainingConfig.from_grpo`).

Plain pydantic: must not import torch (a recipe is checked without it).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpo.configs.rollout import RolloutConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.schedule import ScheduleConfig
from grpo.configs.training import (MOVED_KEYS, GradingConfig, GRPOConfig, LossConfig, MemoryConfig,
                                   OptimizerConfig, nest_flat_keys)

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


class PPOTrainingConfig(BaseModel):
    """The PPO loop's own config: the sections it shares with GRPO, read from the stage's `grpo` section
    (`from_grpo`), and PPO's settings (`ppo`). What GRPO has and PPO does not (LoRA, a prompt mix, a schedule,
    asynchronous rollouts and dynamic sampling) is not among its fields; the parts both loops run on read those as
    GRPO's defaults, which is what `check_ppo_settings` asks of a stage that runs PPO."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    moved_keys: ClassVar[dict[str, str]] = MOVED_KEYS  # `updated(beta=...)` reads flat names as GRPOConfig does

    max_steps: int = Field(200, ge=1)  # optimizer steps (times num_iterations)
    prompts_per_step: int = Field(4, ge=1)  # with num_generations: prompts_per_step x num_generations prompts a step,
    num_generations: int = Field(8, ge=2)  # one completion each (as many completions as GRPO's groups hold)
    num_iterations: int = Field(1, ge=1)  # optimisation passes per batch of samples
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)  # temperature, completion budget
    rewards: dict[str, float] = Field(default_factory=lambda: {"accuracy": 1.0, "format": 0.5})  # name -> weight
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)  # the policy's (and, by default, the critic's)
    loss: LossConfig = Field(default_factory=LossConfig)  # KL coefficient, clip range, token weighing
    memory: MemoryConfig = Field(default_factory=MemoryConfig)  # micro-batches, packing, precision, dtypes
    grading: GradingConfig = Field(default_factory=GradingConfig)  # code reward, appeal, when grading stops the stage
    log_every: int = Field(1, ge=1)  # steps between metric callbacks
    samples_every: int = Field(25, ge=0)  # steps between sample-completion tables (0 = none)
    checkpoint_every: int = Field(50, ge=0)  # steps between resumable checkpoints (0 = only the final model)
    seed: int = 0  # prompt order and sampling
    ppo: PPOConfig = Field(default_factory=PPOConfig)  # GAE, the value loss, where the KL goes, the critic's rate

    # GRPO's settings PPO has none of, as the parts both loops run on read them
    lora: ClassVar[None] = None
    prompt_mix: ClassVar[dict[str, float]] = {}
    rollout: ClassVar[RolloutConfig] = RolloutConfig()
    schedule: ClassVar[ScheduleConfig] = ScheduleConfig()

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_into_sections(cls, data):  # as GRPOConfig reads them
        return nest_flat_keys(data)

    @model_validator(mode="after")
    def _what_ppo_honours(self) -> "PPOTrainingConfig":
        if self.loss.importance_sampling_level != "token":
            raise ValueError("algorithm ppo has an advantage per token: set grpo.loss.importance_sampling_level to "
                             "'token'")
        if self.grading.supervision != "outcome":
            raise ValueError("grpo.grading.supervision 'process' is GRPO's step advantages; algorithm ppo takes the "
                             "outcome reward at each completion's last token: use supervision 'outcome' with ppo")
        return self

    @classmethod
    def from_grpo(cls, grpo: GRPOConfig, ppo: PPOConfig | None = None) -> "PPOTrainingConfig":
        """PPO's config from a stage's `grpo` section and its `ppo` section, refusing (as the recipe does) the GRPO
        settings PPO cannot honour."""
        check_ppo_settings(grpo, None)
        shared = {name: getattr(grpo, name) for name in cls.model_fields if name != "ppo"}
        return cls(**shared, ppo=ppo or PPOConfig())

    updated = GRPOConfig.updated
