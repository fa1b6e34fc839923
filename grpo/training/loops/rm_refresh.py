"""The iterative reward model: alignment GRPO's reward model trained further on the policy's own samples.

DeepSeekMath (section 4.2, "iterative RL") finds that a reward model kept fixed falls behind the policy it scores:
the policy's samples drift from what the reward model was trained on. It retrains the reward model on pairs made
from the policy's latest samples, with 10% of the historical data replayed, and that beats the fixed one. Here,
with `reward_model.refresh_every: N` (off at 0), every N GRPO steps:

1. every group of the steps since the last refresh (G completions of one prompt, from the policy being trained)
   gives at most one pair, its best and worst completions:
   - **by the rule rewards where a rule scored the group** (the reasoning prompts' accuracy, the format and
     language rewards: every reward but the reward model's, with the stage's weights) and they differ: these are
     the only labels the stage has that the reward model did not produce, so they come first;
   - **by the current reward model elsewhere** (general prompts, whose rules all agree): the highest and lowest
     scored, kept only when their gap is at least `refresh_min_margin`. These pairs add no preference the reward
     model did not already hold; they move its training distribution to what the policy writes now (where its
     scores are the ones GRPO acts on), and the margin keeps only the rankings it is sure of. Replay of the
     original human pairs (`refresh_replay`) anchors it to them;
2. the reward model takes `refresh_steps` Bradley-Terry steps (batches of `batch_size` pairs, `refresh_replay` of
   each from the original preference pairs), with an AdamW of its own kept from refresh to refresh;
3. its held-out pair accuracy is measured again (`rm/heldout_accuracy`, at the GRPO step), so a refresh that costs
   accuracy on human preferences shows.

The scorer GRPO reads is the one trained, in place: the next step's rewards come from the refreshed model. Every
process of a launched stage holds its own scorer and sees every process's samples (`gather_table`), so each makes
the same pairs and takes the same steps from the same seed. The refreshed model, its optimizer and the samples not
yet used are in the GRPO checkpoints, so a resumed run scores as the whole run would have; when GRPO ends the
refreshed model is saved beside the policy (`reward_model/`), and the stage logs it as `reward_model_refreshed`.

A refresh batch's 2B sequences go through the model as one row without padding where `reward_model.packing` allows
(as in the reward model's own loop: grpo.training.reward_scorer.sequence_scores), the padded batch's scores to float
rounding.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from grpo.configs.grading import REWARD_MODEL
from grpo.configs.reward import RewardModelConfig
from grpo.kernels.attention import attending_packed
from grpo.training.optimizers import make_adamw
from grpo.training.reward_scorer import (RewardModelScorer, bradley_terry_loss, encode_pairs, evaluate_pairs,
                                         pair_metrics, packs, sequence_scores)

STATE_FILE = "reward_model_refresh.pt"  # in each GRPO checkpoint folder
OUTPUT_FOLDER = "reward_model"  # the refreshed reward model, beside GRPO's `model` when the loop ends


def policy_pairs(table: pd.DataFrame, group_size: int, weights: dict[str, float],
                 min_margin: float) -> pd.DataFrame:
    """At most one pair per group of `table` (rows in groups of `group_size`, in order): `prompt`, `chosen`,
    `rejected`, `ranked_by` ("rule" or "reward_model") and `margin` (rule total or reward-model score gap).

    `table` holds the samples' `prompt`, `completion` and `reward/<name>` columns (NaN or None where a reward did
    not score a row); `weights` the stage's reward weights, the reward model's under "reward_model".
    """
    rules = [name for name in weights if name != REWARD_MODEL and f"reward/{name}" in table.columns]
    pairs = []
    for start in range(0, len(table) - group_size + 1, group_size):
        group = table.iloc[start : start + group_size]
        rule_total = sum(weights[name] * pd.to_numeric(group[f"reward/{name}"], errors="coerce").fillna(0.0)
                         for name in rules) if rules else pd.Series(0.0, index=group.index)
        rm = (pd.to_numeric(group[f"reward/{REWARD_MODEL}"], errors="coerce")
              if f"reward/{REWARD_MODEL}" in group.columns else pd.Series(math.nan, index=group.index))
        scored_by_rule = bool(rules) and any(group[f"reward/{n}"].notna().any() for n in rules)
        if scored_by_rule and rule_total.max() > rule_total.min():
            # the best by the rules (the reward model's score breaks a tie), against the worst
            order = sorted(group.index, key=lambda i: (rule_total[i], 0.0 if math.isnan(rm[i]) else rm[i]))
            best, worst, by, margin = order[-1], order[0], "rule", rule_total[order[-1]] - rule_total[order[0]]
        elif rm.notna().all() and rm.max() - rm.min() >= max(min_margin, 1e-12):
            best, worst, by, margin = rm.idxmax(), rm.idxmin(), REWARD_MODEL, rm.max() - rm.min()
        else:
            continue
        if group.at[best, "completion"] == group.at[worst, "completion"]:
            continue  # the same text twice teaches nothing
        pairs.append({"prompt": group.at[best, "prompt"], "chosen": group.at[best, "completion"],
                      "rejected": group.at[worst, "completion"], "ranked_by": by, "margin": float(margin)})
    return pd.DataFrame(pairs, columns=["prompt", "chosen", "rejected", "ranked_by", "margin"])


class RewardModelRefresh:
    """GRPOTrainer's step hook that retrains its reward model (the `scorer` its reward function reads) on the
    policy's samples every `cfg.refresh_every` steps. `replay`: the original preference pairs; `heldout`: held-out
    pairs whose accuracy is measured after each refresh."""

    def __init__(self, scorer: RewardModelScorer, cfg: RewardModelConfig, weights: dict[str, float],
                 group_size: int, *, replay: pd.DataFrame | None = None, heldout: pd.DataFrame | None = None,
                 source: str = "preferences"):
        if cfg.refresh_every < 1:
            raise ValueError("reward_model.refresh_every must be at least 1 for the reward model to be refreshed")
        if REWARD_MODEL not in weights:
            raise ValueError(f"reward_model.refresh_every trains the reward model GRPO reads: grpo.rewards must "
                             f"name {REWARD_MODEL!r} (it names {sorted(weights)})")
        self.scorer, self.cfg, self.weights, self.group_size = scorer, cfg, dict(weights), group_size
        self.heldout = heldout if heldout is not None and len(heldout) else None
        # the original pairs, encoded now: one that does not fit fails before any GRPO step
        self.replay = (encode_pairs(replay, scorer.tokenizer, cfg.max_seq_len, source)
                       if replay is not None and len(replay) and cfg.refresh_replay > 0 else [])
        self.optimizer = make_adamw(scorer.model, cfg.refresh_learning_rate or cfg.learning_rate, cfg.weight_decay)
        # a refresh batch's sequences as one row without padding (`packing: true` on a model without a score head
        # fails here, before any GRPO step)
        self.packed = packs(cfg.packing, scorer.model)
        self.pending: list[pd.DataFrame] = []  # the samples since the last refresh, a table a step
        self.last_pairs = pd.DataFrame()  # the pairs of the latest refresh (what a test or a person can inspect)
        self.refreshes = 0

    def after_step(self, step: int, table: pd.DataFrame) -> dict[str, float]:
        """Take the step's samples (every process's); on a refresh step, train and return the refresh's figures."""
        self.pending.append(table.reset_index(drop=True))
        if step % self.cfg.refresh_every:
            return {}
        pairs = pd.concat([policy_pairs(t, self.group_size, self.weights, self.cfg.refresh_min_margin)
                           for t in self.pending], ignore_index=True)
        self.pending = []
        self.last_pairs = pairs
        metrics = {"rm/refresh_pairs": float(len(pairs)),
                   "rm/refresh_pairs_by_rule": float((pairs["ranked_by"] == "rule").sum()) if len(pairs) else 0.0}
        if len(pairs) == 0:
            return metrics  # every group agreed: nothing to learn from these steps
        metrics.update(self._train(pairs, step))
        self.refreshes += 1
        if self.heldout is not None:
            metrics.update(evaluate_pairs(self.scorer, self.heldout))
        return metrics

    def _train(self, pairs: pd.DataFrame, step: int) -> dict[str, float]:
        cfg, model = self.cfg, self.scorer.model
        fresh = encode_pairs(pairs, self.scorer.tokenizer, 10**9)  # the policy's samples: never too long to score
        fresh = [type(e)(e.chosen_ids[-self.scorer.max_seq_len:], e.rejected_ids[-self.scorer.max_seq_len:])
                 for e in fresh]  # ends kept, as the scorer reads them
        rng = np.random.default_rng([cfg.seed, 7, step])  # the same draws on every process, and after a resume
        n_replay = round(cfg.batch_size * cfg.refresh_replay) if self.replay else 0
        device = next(model.parameters()).device
        losses, accuracies = [], []
        model.train()
        try:
            with attending_packed(model, self.packed):  # packed rows attend sequence by sequence
                for _ in range(cfg.refresh_steps):
                    batch = [fresh[i] for i in rng.integers(len(fresh), size=cfg.batch_size - n_replay)]
                    batch += [self.replay[i] for i in rng.integers(len(self.replay), size=n_replay)] if n_replay else []
                    B = len(batch)
                    # chosen and rejected in one forward: rows [0, B) are chosen, [B, 2B) their rejected partners
                    rewards = sequence_scores(model, [e.chosen_ids for e in batch] + [e.rejected_ids for e in batch],
                                              model.config.pad_token_id, device,
                                              packed_for=model if self.packed else None)  # [2B]
                    loss = bradley_terry_loss(rewards[:B], rewards[B:])
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    losses.append(loss.item())
                    accuracies.append(pair_metrics(rewards[:B], rewards[B:])["accuracy"])
        finally:
            model.eval()
        return {"rm/refresh_loss": sum(losses) / len(losses), "rm/refresh_accuracy": sum(accuracies) / len(accuracies)}

    def finish(self, output_dir: Path) -> None:
        """The refreshed reward model, loadable as the trained one is, in `output_dir/reward_model`."""
        folder = Path(output_dir) / OUTPUT_FOLDER
        self.scorer.model.save_pretrained(folder)
        self.scorer.tokenizer.save_pretrained(folder)

    # -- in GRPO's checkpoints -----------------------------------------------------------------------------------

    def save(self, folder: Path) -> None:
        torch.save({"model": self.scorer.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "pending": [t.to_dict("list") for t in self.pending], "refreshes": self.refreshes},
                   Path(folder) / STATE_FILE)

    def load(self, folder: Path) -> None:
        path = Path(folder) / STATE_FILE
        if not path.exists():
            raise ValueError(f"{folder}: this GRPO checkpoint holds no refreshed reward model; it was written by a "
                             f"run without reward_model.refresh_every")
        state = torch.load(path, weights_only=False)
        self.scorer.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.pending = [pd.DataFrame(t) for t in state["pending"]]
        self.refreshes = state["refreshes"]
