"""The alignment stage's watch: the true score beside the reward models', and the line when one falls while the
other rises, on planted step tables whose true verdicts are known."""

from __future__ import annotations

import logging
import random

import pandas as pd
import pytest

from grpo.data.general import chosen_response, split_prompts
from grpo.data.preferences import rejected_response
from grpo.training.alignment_watch import AlignmentWatch
from grpo.training.grading import GradingStop

G = 4


def _prompts():
    chosen = [p for p in split_prompts("train") if p.category == "benign"][:2] + \
             [p for p in split_prompts("train") if p.category == "harmful"][:2]
    table = pd.DataFrame({"prompt": [p.text for p in chosen], "kind": "general",
                          "category": [p.category for p in chosen], "reference": [p.reference for p in chosen]})
    reasoning = pd.DataFrame({"prompt": ["Compute 1 + 2."], "kind": "reasoning", "category": [None],
                              "reference": [None]})
    return chosen, pd.concat([table, reasoning], ignore_index=True)


def _step(chosen, right_per_group: list[int], score: float) -> pd.DataFrame:
    """A step's table: each prompt's group of G with its first `right` samples right and the rest wrong (a refusal
    of a benign prompt, compliance with a harmful one), every general row scored `score` by the reward model, and
    a reasoning group the watch must leave out."""
    rng = random.Random(0)
    rows = []
    for p, right in zip(chosen, right_per_group):
        wrong = rejected_response(p, "refusal" if p.category == "benign" else "complies", rng)
        for i in range(G):
            rows.append({"prompt": p.text, "completion": chosen_response(p) if i < right else wrong,
                         "reward/helpfulness": score if p.category == "benign" else None,
                         "reward/harmlessness": score if p.category == "harmful" else None})
    rows += [{"prompt": "Compute 1 + 2.", "completion": "<answer>3</answer>", "reward/helpfulness": None,
              "reward/harmlessness": None}] * G
    return pd.DataFrame(rows)


def test_the_step_figures_are_the_true_verdicts_of_the_general_rows_alone():
    chosen, prompts = _prompts()
    watch = AlignmentWatch(prompts, ["helpfulness", "harmlessness"], G, every=100)
    out = watch.after_step(1, _step(chosen, [4, 2, 0, 3], 1.5))
    # right: 4 + 2 + 0 + 3 of 16; mixed groups: the second and the fourth; refusals: none in group 1, the 2 wrong
    # ones of group 2, none in group 3 (all comply), the 3 right ones of group 4: 5 of 16
    assert out["general/handled_right"] == 9 / 16
    assert out["general/mixed_groups"] == 2 / 4
    assert out["general/refused"] == (2 + 0 + 3) / 16
    assert out["general/rm_score"] == 1.5
    assert "watch/true_score" not in out  # no window closed yet


def test_a_true_score_that_falls_while_the_reward_rises_is_said_once_in_a_line(caplog):
    chosen, prompts = _prompts()
    watch = AlignmentWatch(prompts, ["helpfulness", "harmlessness"], G, every=2, windows=3)
    seen = []
    with caplog.at_level(logging.WARNING, logger="grpo.training.alignment_watch"):
        # windows of 2 steps: the true score 4/4, 3/4, 2/4, 1/4 of each group while the reward climbs 0, 1, 2, 3
        for step in range(1, 9):
            k = (step - 1) // 2
            seen.append(watch.after_step(step, _step(chosen, [4 - k] * 4, float(k))))
    windows = [o for o in seen if "watch/true_score" in o]
    assert [o["watch/true_score"] for o in windows] == [1.0, 0.75, 0.5, 0.25]
    assert [o["watch/rm_score"] for o in windows] == [0.0, 1.0, 2.0, 3.0]
    assert [o["watch/overoptimised"] for o in windows] == [0.0, 0.0, 0.0, 1.0]  # three falls need four windows
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("over-optimisation at step 8: the true score fell")
    assert "1.000 -> 0.750 -> 0.500 -> 0.250" in lines[0] and "0.000 -> 1.000 -> 2.000 -> 3.000" in lines[0]


def test_a_falling_true_score_under_a_falling_reward_is_not_over_optimisation(tmp_path):
    chosen, prompts = _prompts()
    watch = AlignmentWatch(prompts, ["helpfulness", "harmlessness"], G, every=1, windows=2)
    flags = [watch.after_step(s, _step(chosen, [4 - s] * 4, -float(s)))["watch/overoptimised"] for s in range(4)]
    assert flags == [0.0] * 4
    # its state travels in a checkpoint: a resumed watch continues the same windows
    watch.save(tmp_path)
    again = AlignmentWatch(prompts, ["helpfulness", "harmlessness"], G, every=1, windows=2)
    again.load(tmp_path)
    assert again.history == watch.history


def test_with_stop_it_stops_the_run_and_without_a_category_it_refuses_to_start():
    chosen, prompts = _prompts()
    watch = AlignmentWatch(prompts, ["helpfulness", "harmlessness"], G, every=1, windows=1, stop=True)
    watch.after_step(1, _step(chosen, [4] * 4, 0.0))
    with pytest.raises(GradingStop, match="over-optimisation at step 2.*stopped there"):
        watch.after_step(2, _step(chosen, [1] * 4, 5.0))
    with pytest.raises(ValueError, match="category"):
        AlignmentWatch(prompts.drop(columns=["category"]), ["reward_model"], G)
