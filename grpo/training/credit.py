"""What each completion of a GRPO step is credited with: the loop's advantage, as a part chosen once per run.

- `GroupOutcome`: each completion's reward against its group's, (r - mean) / std (grpo.training.advantages);
- `ProcessSupervision`: every reasoning step rewarded by a step verifier, each token's advantage the sum of the
  normalised rewards of the steps that end at or after it (grpo.training.process);
- `RFTCoefficients`: online RFT's coefficient, 1 for a correct sample and 0 otherwise, with no baseline
  (grpo.training.rft).

Each has `judge` (the step's scores to what the advantages are made from, and how many groups carry a gradient) and
`advantages` (those to each row's advantage, and the rows that train); `advantage_function` picks one from the
config. The loop calls them without knowing which it holds.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import pandas as pd
import torch

from grpo.configs.training import GRPOConfig
from grpo.rewards.steps import STEP_VERIFIER_FUNCTIONS, StepVerifier
from grpo.sampling.engines import Rollout
from grpo.training.advantages import group_advantages, trained_rows
from grpo.training.grading import signal_groups
from grpo.training.policy import row_columns
from grpo.training.process import (StepRewards, graded_by_steps, process_advantages, score_steps, step_metrics,
                                   token_char_ends)


class Judged(NamedTuple):
    """A step's scores as an advantage function reads them."""

    scores: object  # the step's scores (process supervision: a completion its verifier could not check, ungraded)
    rewards: list[float]  # [N] what the advantages are made from: each total reward, or RFT's coefficients
    steps: StepRewards | None  # process supervision's step rewards; None otherwise
    spread: int  # this process's groups that carry a gradient


class GroupOutcome:
    """GRPO's outcome advantage: (r - group mean) / group std over each group's graded rows."""

    def __init__(self, cfg: GRPOConfig):
        self.G, self.scale = cfg.num_generations, cfg.loss.scale_rewards

    def judge(self, rollout: Rollout, idx: list[int], scores, metrics: dict[str, float], first: bool) -> Judged:
        return Judged(scores, scores.total, None, signal_groups(scores.total, scores.graded_rows, self.G))

    def advantages(self, rewards: list[float], graded: list[bool] | None, steps: StepRewards | None,
                   C: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N] advantages, and [N] the rows that train where some are not graded (else None)."""
        trains = None if graded is None or all(graded) else trained_rows(graded, self.G)
        return group_advantages(torch.tensor(rewards, dtype=torch.float32), self.G, scale=self.scale,
                                graded=None if trains is None else torch.tensor(graded)), trains  # [N]


class ProcessSupervision:
    """Process supervision: a reward at the end of every reasoning step (a step verifier's), then the answer's."""

    def __init__(self, cfg: GRPOConfig, tokenizer, prompts: pd.DataFrame, verifier: StepVerifier):
        self.G, self.scale, self.name = cfg.num_generations, cfg.loss.scale_rewards, cfg.grading.step_verifier
        self.tokenizer, self.verifier, self.outcome = tokenizer, verifier, GroupOutcome(cfg)
        prompts = prompts.reset_index(drop=True)
        self.cells = prompts["prompt"].tolist()
        self.columns = {c: prompts[c].tolist() for c in prompts.columns if c != "prompt"}

    def score_steps(self, rollout: Rollout, idx: list[int], outcome: list[float],
                    metrics: dict[str, float] | None = None, first: bool = False) -> StepRewards:
        """Every completion's checked steps, then its answer step rewarded with `outcome`.

        On the run's `first` step a verifier that finds no step in any completion does not fit the data: an error
        then, rather than a run of outcome GRPO under another name.
        """
        chars = token_char_ends(self.tokenizer, rollout.completion_ids, rollout.completion_mask, rollout.texts)
        columns = row_columns(self.columns, self.cells, idx, self.G)
        steps = score_steps(self.verifier, rollout.texts, columns, outcome, chars, name=self.name)
        if first and not any(steps.checked) and not all(steps.ungraded or []):  # all ungraded: the watch's to say
            raise ValueError(f"step_verifier {self.name!r} found no step in any of the first "
                             f"{len(rollout.texts)} completions (one reads {rollout.texts[0][:200]!r}); choose a "
                             f"step verifier that reads this data's reasoning")
        if metrics is not None:
            metrics.update(step_metrics(steps))
        return steps

    def judge(self, rollout: Rollout, idx: list[int], scores, metrics: dict[str, float], first: bool) -> Judged:
        steps = self.score_steps(rollout, idx, scores.total, metrics, first)
        scores = graded_by_steps(scores, steps)  # a completion the verifier could not check is ungraded
        return Judged(scores, scores.total, steps,
                      signal_groups(scores.total, scores.graded_rows, self.G, steps.rewards))

    def advantages(self, rewards: list[float], graded: list[bool] | None, steps: StepRewards | None,
                   C: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, C] advantages, one a token, and [N] the rows that train where some are not graded (else None); without
        step rewards, the group outcome's [N]."""
        if steps is None:
            return self.outcome.advantages(rewards, graded, steps, C)
        trains = None if graded is None or all(graded) else trained_rows(graded, self.G)
        return process_advantages(steps.rewards, steps.ends, self.G, C, scale=self.scale,
                                  graded=None if trains is None else trains.tolist()), trains  # [N, C]


class RFTCoefficients:
    """Online RFT: each sample's coefficient from the step's scores in place of an advantage; no baseline, no scale."""

    def __init__(self, cfg: GRPOConfig, coefficients: Callable[[object], torch.Tensor]):
        self.G, self.coefficients = cfg.num_generations, coefficients

    def judge(self, rollout: Rollout, idx: list[int], scores, metrics: dict[str, float], first: bool) -> Judged:
        rewards, graded = self.coefficients(scores).tolist(), scores.graded_rows  # [N]
        correct = [c for c, g in zip(rewards, graded) if g]  # 1.0 for a correct sample, 0.0 otherwise
        metrics["rft/correct"] = sum(correct) / len(correct) if correct else float("nan")
        return Judged(scores, rewards, None, signal_groups(rewards, graded, self.G, baseline=False))

    def advantages(self, rewards: list[float], graded: list[bool] | None, steps: StepRewards | None,
                   C: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N] the coefficients as they are; a graded sample trains whatever its group's others."""
        trains = None if graded is None or all(graded) else torch.tensor(graded)
        return torch.tensor(rewards, dtype=torch.float32), trains  # [N]


AdvantageFunction = GroupOutcome | ProcessSupervision | RFTCoefficients


def advantage_function(cfg: GRPOConfig, tokenizer, prompts: pd.DataFrame,
                       step_verifiers: Mapping[str, StepVerifier] | None = None,
                       coefficients: Callable[[object], torch.Tensor] | None = None) -> AdvantageFunction:
    """The run's advantage: RFT's `coefficients` where given (grpo.training.rft.coefficient_function), process
    supervision's with its step verifier by name (or one the caller brings: a process reward model), else GRPO's
    group outcome. A step verifier that is not there fails here, before any model work."""
    if coefficients is not None:
        return RFTCoefficients(cfg, coefficients)
    if cfg.grading.supervision == "process":
        verifiers = {**STEP_VERIFIER_FUNCTIONS, **(step_verifiers or {})}
        if cfg.grading.step_verifier not in verifiers:
            raise ValueError(f"step_verifier {cfg.grading.step_verifier!r} is not available here (known: "
                             f"{sorted(verifiers)}); 'prm' needs a process reward model passed in "
                             f"step_verifiers (grpo.training.loops.prm.prm_step_verifier)")
        return ProcessSupervision(cfg, tokenizer, prompts, verifiers[cfg.grading.step_verifier])
    return GroupOutcome(cfg)
