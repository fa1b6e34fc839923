"""The appeal: a judge looks again at the accuracy rule's negatives and may only raise them (grpo.training.appeal)."""

from __future__ import annotations

import pandas as pd
import pytest

from grpo.configs.grading import JudgeConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.rewards import accuracy_reward
from grpo.sampling.judge import Verdict
from grpo.training.appeal import appealed
from grpo.training.loops.grpo_trainer import GRPOTrainer
from judges import scripted_judge
from tiny_configs import SMALL


class _Says:
    """A judge object that answers every item with one verdict (the interface, in process)."""

    def __init__(self, accepted):
        self.accepted, self.items = accepted, []

    def judge_many(self, items):
        self.items += items
        return [Verdict(self.accepted, "said so") for _ in items]


def test_an_appeal_only_raises_the_rules_negatives_and_counts_its_calls():
    completions = ["<answer>1/2</answer>", "<answer>0.5</answer>", "<answer>one half</answer>", "<answer>7</answer>"]
    answers = ["0.5", "0.5", "0.5", None]
    rule = accuracy_reward(completions, answers)
    assert rule == [1.0, 1.0, 0.0, None]
    yes, no = _Says(True), _Says(False)
    assert appealed(accuracy_reward, yes)(completions, answer=answers, prompts=["q"] * 4) == [1.0, 1.0, 1.0, None]
    assert [item[2] for item in yes.items] == ["0.5"]  # only the negative, with its reference
    down = appealed(accuracy_reward, no)
    assert down(completions, answer=answers, prompts=["q"] * 4) == rule  # a no changes nothing: never lower
    assert down.take_figures() == {"appeal_calls": 1.0, "appeal_upheld": 0.0} and down.take_figures()["appeal_calls"] == 0


PROMPTS = pd.DataFrame({"prompt": [f"What is {i} plus zero?" for i in range(4)], "answer": [str(i) for i in range(4)]})


@pytest.mark.parametrize("verdict", ["yes", "no"])
def test_grpo_with_an_appeal_over_http_scores_the_judges_yes_and_logs_its_calls(tmp_path, verdict):
    with scripted_judge(verdict) as (url, handler):
        model, tok = load_model_and_tokenizer(SMALL)
        cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=4, checkpoint_every=0, mixed_precision="no",
                         sampling=SamplingConfig(max_new_tokens=8), rewards={"accuracy": 1.0},
                         appeal=JudgeConfig(backend="http", base_url=url, model="judge", backoff_s=0.01))
        seen = {}
        trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, progress=False,
                              on_metrics=lambda step, m: seen.__setitem__(step, m))
        trainer.train()
        m = seen[1]
        negatives = m["reward_figures/accuracy/appeal_calls"]
        assert negatives == len(handler.asked) > 0  # a random model's answers are wrong: each went to the judge
        if verdict == "yes":
            assert m["reward_figures/accuracy/appeal_upheld"] == negatives and m["reward/accuracy"] == 1.0
        else:
            assert m["reward_figures/accuracy/appeal_upheld"] == 0 and m["reward/accuracy"] < 1.0
        assert "Reference answer:" in handler.asked[0]
