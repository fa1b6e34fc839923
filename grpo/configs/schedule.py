"""What changes while a GRPO run goes on: rewards that count only from some step, and a reference that moves.

R1's last stage adds its reward models' rewards only for the last part of training (longer training on them led to
reward hacking), and DeepSeekMath's iterative GRPO resets the KL term's reference to the current policy; both are
settings here, under a stage's `grpo.schedule`:

    grpo:
      schedule:
        rewards_from: {helpfulness: 0.5, harmlessness: 0.5}   # these two count in the second half of the steps
        reference_every: 10                                   # the reference becomes the policy every 10 steps

Plain pydantic: must not import torch (a recipe is checked without it).
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class ScheduleConfig(BaseModel):
    """When a reward starts to count, and how often the KL term's reference is refreshed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # reward name -> the share of max_steps done before it counts (0: from the first step): the reward is not computed
    # before then, and the other rewards carry those steps
    rewards_from: dict[str, Annotated[float, Field(ge=0, lt=1)]] = Field(default_factory=dict)
    # optimizer steps between copies of the policy into the KL term's reference (0: the starting checkpoint throughout)
    reference_every: int = Field(0, ge=0)

    def first_step(self, reward: str, max_steps: int) -> int:
        """The first step (0-based) at which `reward` counts in a run of `max_steps`."""
        return math.ceil(self.rewards_from.get(reward, 0.0) * max_steps)

    def rewards_at(self, rewards: dict[str, float], step: int, max_steps: int) -> dict[str, float]:
        """The rewards (name -> weight) that count at `step` (0-based) of a run of `max_steps`."""
        return {name: w for name, w in rewards.items() if step >= self.first_step(name, max_steps)}

    def check(self, rewards: dict[str, float], max_steps: int, beta: float, reference_kept: bool) -> None:
        """Raise where the schedule does not fit the run's rewards and KL term; `reference_kept`: the trainer holds a
        reference model of its own (not with LoRA, whose reference is the policy with its adapters off, nor when the
        sampler workers score the reference)."""
        unknown = sorted(set(self.rewards_from) - set(rewards))
        if unknown:
            raise ValueError(f"schedule.rewards_from names {unknown}, which rewards does not: it names "
                             f"{sorted(rewards)}")
        if not self.rewards_at(rewards, 0, max_steps):
            raise ValueError(f"schedule.rewards_from starts every reward after the first step ({self.rewards_from}): "
                             f"at least one reward must count from the start")
        if self.reference_every and (beta == 0 or not reference_kept):
            raise ValueError("schedule.reference_every copies the policy into the KL term's reference: it needs "
                             "beta > 0, no LoRA (whose reference is the policy with its adapters off) and "
                             "rollout.reference trainer; set reference_every: 0")
