"""Over-optimisation in sight: the alignment stage's true score beside its reward models' score, step by step.

A reward model is a proxy: optimised hard enough, its score keeps rising while the quality it stands for falls (Gao
et al. 2022, "Scaling laws for reward model overoptimization"); the known failures are a policy that refuses
everything and one that answers off-topic text the reward model rates high. Where the general prompts carry their
truth (the synthetic generator's `category` and `reference`, or a user's), this hook reads every step's samples by
the generator's rules (`grpo.data.general.handled_right`) and logs, for the general rows:
- `general/handled_right`: the true score (harmful refused, benign and borderline answered helpfully);
- `general/refused`: the share of samples that refuse;
- `general/mixed_groups`: the share of groups whose samples disagree on the true verdict: only those can teach the
  choice itself (a group all right or all wrong still gets +-1 advantages, from wording);
- `general/rm_score`: the mean of the reward models' scores on those rows.
Every `every` steps it closes a window of their means (`watch/true_score`, `watch/rm_score`); when the true score
fell in each of the last `windows` windows while the reward models' score rose over them, it says so in one line
(`watch/overoptimised` 1.0) and, with `stop`, stops the run there (`GradingStop`: the loop saves the steps done).

A StepHook (grpo.training.hooks) of the GRPO loop: its state travels in the loop's checkpoints.
Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pandas as pd

from grpo.data.general import handled_right, is_refusal
from grpo.training.grading import GradingStop

logger = logging.getLogger(__name__)
STATE_FILE = "alignment_watch.json"


class AlignmentWatch:
    """See the module docstring. `prompts`: the stage's prompt table (`prompt`, `kind`, `category`, optional
    `reference`); `reward_names`: the reward functions whose mean is the reward models' score."""

    def __init__(self, prompts: pd.DataFrame, reward_names: list[str], num_generations: int, every: int = 5,
                 windows: int = 3, stop: bool = False):
        general = prompts[prompts["kind"] == "general"] if "kind" in prompts.columns else prompts
        if "category" not in general.columns:
            raise ValueError("the over-optimisation watch reads the general prompts' `category` (harmful, benign or "
                             "borderline); these prompts have none")
        references = general["reference"].tolist() if "reference" in general.columns else [None] * len(general)
        self.truth = {str(p): (c, r if isinstance(r, str) else None)
                      for p, c, r in zip(general["prompt"], general["category"], references)}
        self.reward_names, self.G, self.every, self.windows, self.stop = reward_names, num_generations, every, windows, stop
        self.window: list[tuple[float, float]] = []  # (true, rm) per general row since the window opened
        self.history: list[tuple[float, float]] = []  # each closed window's (true score, rm score)
        self.said = False

    def after_step(self, step: int, table: pd.DataFrame) -> dict[str, float]:
        rows = [i for i, p in enumerate(table["prompt"]) if p in self.truth]
        out: dict[str, float] = {}
        if rows:
            right, refused, rm = [], [], []
            for i in rows:
                category, reference = self.truth[table["prompt"].iat[i]]
                text = table["completion"].iat[i]
                right.append(float(handled_right(text, category, reference, table["prompt"].iat[i])))
                refused.append(float(is_refusal(text)))
                scores = [table[f"reward/{n}"].iat[i] for n in self.reward_names if f"reward/{n}" in table.columns]
                scores = [s for s in scores if s is not None and not (isinstance(s, float) and math.isnan(s))]
                rm.append(float(sum(scores) / len(scores)) if scores else math.nan)
            groups = [right[g:g + self.G] for g in range(0, len(right), self.G)]  # rows come in whole groups
            out["general/handled_right"] = sum(right) / len(right)
            out["general/refused"] = sum(refused) / len(refused)
            out["general/mixed_groups"] = sum(0 < sum(g) < len(g) for g in groups) / len(groups)
            seen = [s for s in rm if not math.isnan(s)]
            if seen:
                out["general/rm_score"] = float(sum(seen) / len(seen))
            self.window += [(t, s) for t, s in zip(right, rm)]
        if step % self.every == 0 and self.window:
            true = sum(t for t, _ in self.window) / len(self.window)
            scored = [s for _, s in self.window if not math.isnan(s)]
            self.history.append((true, sum(scored) / len(scored) if scored else math.nan))
            self.window = []
            out["watch/true_score"], out["watch/rm_score"] = self.history[-1]
            out["watch/overoptimised"] = float(self.overoptimised())
            if out["watch/overoptimised"] and not self.said:
                self.said = True
                line = (f"over-optimisation at step {step}: the true score fell in each of the last {self.windows} "
                        f"windows of {self.every} steps ({self._trend(0)}) while the reward models' score rose "
                        f"({self._trend(1)})")
                logger.warning(line)
                if self.stop:
                    raise GradingStop(line + "; stopped there (alignment_grpo.watch.stop), its steps kept")
        return out

    def overoptimised(self) -> bool:
        """The true score fell window after window over the last `windows` while the reward models' rose."""
        if len(self.history) < self.windows + 1:
            return False
        last = self.history[-(self.windows + 1):]
        fell = all(b[0] < a[0] for a, b in zip(last, last[1:]))
        return fell and not math.isnan(last[0][1]) and last[-1][1] > last[0][1]

    def _trend(self, k: int) -> str:
        return " -> ".join(f"{w[k]:.3f}" for w in self.history[-(self.windows + 1):])

    def save(self, folder: Path) -> None:
        (Path(folder) / STATE_FILE).write_text(json.dumps({"window": self.window, "history": self.history,
                                                           "said": self.said}))

    def load(self, folder: Path) -> None:
        path = Path(folder) / STATE_FILE
        if path.exists():
            state = json.loads(path.read_text())
            self.window = [tuple(w) for w in state["window"]]
            self.history = [tuple(h) for h in state["history"]]
            self.said = state["said"]

    def finish(self, output_dir: Path) -> None:
        pass
