"""Online RFT's gradient coefficient: 1 for a correct sample, 0 otherwise.

DeepSeekMath (section 5.2.1) writes SFT, RFT, online RFT, DPO, PPO and GRPO as one gradient,

    ∇θ J = E[(q, o) ~ D] [ (1/|o|) Σ_t GC(q, o, t, π_rf) · ∇θ log πθ(o_t | q, o_<t) ],

where the algorithms differ in the data source D (offline, or sampled from the current policy), the reward function
π_rf (a rule or a model) and the gradient coefficient GC each gives a sample. Online RFT samples from the current
policy (as GRPO does) and gives

    GC(q, o, t) = I(o)        1 if the completion o is correct, 0 otherwise,

with no baseline and no normalisation: a correct sample is pushed up by the same amount whatever its group did (GRPO
gives an all-correct group advantage 0), and a wrong one is never pushed down (GRPO's negative advantages). Here
the coefficient takes the advantage's place in GRPO's objective (`grpo.training.loss.grpo_loss`), so with
num_iterations 1 (ratio exactly 1) the per-token loss is -I(o) + β·KL_t and its gradient is the formula's, plus the
same k3 KL penalty to the reference that GRPO has (β = 0 drops it, as the paper's RFT has none); with
num_iterations > 1 the ratio is clipped as GRPO's is. Which reward says "correct" is `grpo.configs.rft`.

Pure functions: must not depend on models, Prefect or MLflow.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from grpo.configs.rft import OnlineRFTConfig


def rft_coefficients(scores: Sequence[float | None], threshold: float) -> Tensor:
    """Each sample's coefficient [N]: 1.0 where its correctness score is at least `threshold`, else 0.0 (a score of
    None, a completion the reward could not score, is not correct).

    >>> rft_coefficients([1.0, 0.0, None, 0.5], threshold=1.0)
    tensor([1., 0., 0., 0.])
    """
    return torch.tensor([1.0 if s is not None and s >= threshold else 0.0 for s in scores])  # [N]


def coefficient_function(cfg: OnlineRFTConfig) -> Callable[[object], Tensor]:
    """What the GRPO trainer calls with a step's scores (`grpo.rewards.score_completions`) to get the coefficients
    it trains with in place of group advantages."""
    def coefficients(scores) -> Tensor:
        if cfg.correct_reward not in scores.per_function:
            raise ValueError(f"online_rft.correct_reward {cfg.correct_reward!r} was not scored this step (scored: "
                             f"{sorted(scores.per_function)}); add it to grpo.rewards")
        return rft_coefficients(scores.per_function[cfg.correct_reward], cfg.threshold)

    return coefficients
