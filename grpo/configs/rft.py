"""Online RFT's own settings, for running the reasoning stage as online rejection-sampling fine-tuning instead of
GRPO (`algorithm: online_rft`).

Online RFT (DeepSeekMath, section 5.2.1) samples from the current policy like GRPO and trains on the correct samples
only: each sample's gradient coefficient is 1 when it is correct and 0 otherwise, with no baseline and no
normalisation (`grpo.training.rft`). Everything it shares with GRPO (sampler, rewards, KL coefficient `beta`,
learning rate, steps, micro-batches, precision, metrics) stays in the stage's `grpo` section, so a recipe switches
algorithm with one line and the two are measured on the same code.

What "correct" means: the score of one named reward function reaching a threshold, by default the accuracy reward
at 1.0 (the answer verified against the reference). That is the paper's definition (the answer's correctness), and
it is kept apart from the weighted total on purpose: the total mixes in format, language or length shaping, whose
partial credit would make a wrong answer with a tidy format count as correct (or, with a threshold at the total's
maximum, a right answer with one shaping term short count as wrong). A code task names `code` (the share of tests
passed; 1.0: every test passes).

Plain pydantic: must not import torch (a recipe is checked without it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from grpo.configs.training import GRPOConfig


class OnlineRFTConfig(BaseModel):
    """Which reward says that a sample is correct, and from what score on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # the reward function (one of grpo.rewards) whose score says whether a completion is correct; its weight in
    # grpo.rewards only matters for the reward figures, never for the coefficient
    correct_reward: str = "accuracy"
    # a completion is correct when that score is at least this (accuracy and code: 1.0, a verified answer and every
    # test passing); a completion the reward cannot score (None) is never correct
    threshold: float = 1.0
    # where the samples come from: "policy", the model being trained (online RFT); "initial", the stage's starting
    # model, frozen (DeepSeekMath's offline RFT: the same loop, its data fixed at the start)
    sampler: Literal["policy", "initial"] = "policy"


def check_rft_settings(grpo: GRPOConfig, rft: OnlineRFTConfig) -> None:
    """Raise on GRPO settings online RFT cannot honour, naming the field."""
    if rft.correct_reward not in grpo.rewards:
        raise ValueError(f"online_rft.correct_reward {rft.correct_reward!r} is not among grpo.rewards "
                         f"{sorted(grpo.rewards)}: the coefficient reads that reward's score, so the stage must "
                         f"compute it (add it to grpo.rewards, with weight 0 if it should not count in reward/total)")
    if grpo.grading.supervision != "outcome":
        raise ValueError("grpo.grading.supervision 'process' is GRPO's step advantages; algorithm online_rft gives "
                         "each "
                         "completion one coefficient: use supervision 'outcome' with online_rft")
    if rft.sampler == "initial" and grpo.rollout.asynchronous:
        raise ValueError("online_rft.sampler 'initial' samples from the frozen starting model in the trainer's own "
                         "process; rollout.mode async samples from pushed policy weights: use rollout.mode sync")
    if grpo.rollout.dynamic_sampling:
        raise ValueError("grpo.rollout.dynamic_sampling drops groups whose rewards all agree, which carry no GRPO "
                         "gradient; "
                         "under algorithm online_rft an all-correct group carries a full one: set it to false")
