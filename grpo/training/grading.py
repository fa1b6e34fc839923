"""A run's grading, watched step by step: it stops, in one line, when its graders keep failing, and says so when its
groups have stopped carrying any signal.

- **Ungraded rows** (`grpo.rewards.outcomes`: a check that timed out, a sandbox or judge that failed, a reward
  function that raised) are no reward, and the loops leave them out. A run whose graders fail for a share of its
  rows past `max_ungraded_share`, over the last `ungraded_window` steps, would go on learning from a biased few: it
  stops with one line naming the grader and its top reason, its checkpoint kept, and the same command resumes once
  the grader is fixed.
- **No signal**: a step whose groups all tie (no reward spread in any group: every advantage 0) teaches nothing
  but the KL term. After `no_signal_steps` such steps in a row the run says so in one line, and stops where the
  recipe asks (`stop_without_signal`).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import NamedTuple

from grpo.faults import Fault

logger = logging.getLogger(__name__)


class GradingStop(Fault):
    """A run stopped for its grading (too many rows ungraded, or no signal where the recipe asks to stop)."""


class StepGrading(NamedTuple):
    """One step's grading, over every process's rows."""

    rows: int
    ungraded: int  # rows some weighted grader could not grade
    reasons: Counter  # (reward function, reason) -> rows
    groups: int
    spread: int  # groups whose graded rows' rewards differ (the ones that carry a gradient)

    def plus(self, other: StepGrading) -> StepGrading:
        return StepGrading(self.rows + other.rows, self.ungraded + other.ungraded, self.reasons + other.reasons,
                           self.groups + other.groups, self.spread + other.spread)


def signal_groups(rewards: list[float], graded: list[bool], group_size: int,
                  step_rewards: list[list[float]] | None = None, baseline: bool = True) -> int:
    """How many groups (`group_size` rows each) carry a gradient, over their graded rows. With a baseline (the
    group's mean): those of two or more graded rows whose rewards differ (`step_rewards`: every step reward of the
    rows, process supervision's). Without one (online RFT's coefficients): those with a graded row of non-zero
    reward.

    >>> rewards = [1.0, 0.0, 1.0, 1.0]  # the second group ties: no spread, yet both its rows are pushed up in RFT
    >>> signal_groups(rewards, [True] * 4, 2), signal_groups(rewards, [True] * 4, 2, baseline=False)
    (1, 2)
    """
    groups = [[i for i in range(g * group_size, (g + 1) * group_size) if graded[i]]
              for g in range(len(graded) // group_size)]
    if not baseline:
        return sum(any(rewards[i] != 0 for i in rows) for rows in groups)
    values = [[v for i in rows for v in ([rewards[i]] if step_rewards is None else step_rewards[i])]
              for rows in groups if len(rows) >= 2]
    return sum(bool(v) and max(v) > min(v) for v in values)


class GradingWatch:
    """Feed it each step's `StepGrading` (`observe`), before the step trains; it raises `GradingStop` when the run
    must stop. `stage` names the run in its lines ("reasoning GRPO")."""

    def __init__(self, max_share: float, window: int, no_signal_steps: int, stop_without_signal: bool,
                 stage: str = "the run"):
        self.max_share, self.window, self.no_signal_steps = max_share, window, no_signal_steps
        self.stop_without_signal, self.stage = stop_without_signal, stage
        self.recent: deque[StepGrading] = deque(maxlen=window)
        self.flat = 0  # steps in a row without reward spread in any group

    def observe(self, step: int, grading: StepGrading) -> str | None:
        """Take step `step`'s (0-based) grading; the no-signal line when it is due (also logged), else None."""
        self.recent.append(grading)
        if len(self.recent) == self.window and self.max_share < 1.0:
            rows = sum(g.rows for g in self.recent)
            ungraded = sum(g.ungraded for g in self.recent)
            if rows and ungraded / rows > self.max_share:
                raise GradingStop(self.ungraded_line(step, ungraded, rows))
        self.flat = self.flat + 1 if grading.groups and not grading.spread else 0
        if self.flat == self.no_signal_steps:
            line = (f"{self.stage}: no learning signal for {self.flat} steps in a row (steps {step + 2 - self.flat}-"
                    f"{step + 1}): every group's rewards tie, so every advantage is 0 and only the KL term acts. "
                    f"The prompts may be too hard or too easy for the policy, or a reward may score everything alike")
            if self.stop_without_signal:
                raise GradingStop(line + "; stopped (grpo.grading.stop_without_signal), its checkpoint kept: the same "
                                         "command resumes")
            logger.warning(line)
            return line
        return None

    def ungraded_line(self, step: int, ungraded: int, rows: int) -> str:
        reasons = sum((g.reasons for g in self.recent), Counter())
        (name, reason), count = reasons.most_common(1)[0] if reasons else (("a reward", "unknown"), ungraded)
        return (f"{self.stage} stopped before step {step + 1}: {ungraded} of the last {rows} rows ({ungraded / rows:.0%}"
                f", over {len(self.recent)} steps) could not be graded, past grpo.grading.max_ungraded_share "
                f"{self.max_share:.0%}; the grader {name!r} most often, for {reason} ({count} rows). Ungraded rows "
                f"train nothing; fix the grader (or raise the share) and the same command resumes at step {step + 1}, "
                f"the steps before it kept")
