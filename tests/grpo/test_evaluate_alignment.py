"""The alignment measures against a scripted engine whose answers are known, so every share is exact."""

from __future__ import annotations

import random

import pandas as pd
import pytest
import torch

from grpo.configs.sampling import EvalConfig, SamplingConfig
from grpo.data.general import chosen_response, split_prompts
from grpo.data.preferences import rejected_response
from grpo.evaluate import evaluate_alignment, paired_alignment
from grpo.sampling.rollout import Rollout


class ScriptedEngine:
    """Answers each prompt with the text it was given for it; records what it was asked."""

    def __init__(self, answers: dict[str, str]):
        self.answers, self.calls = answers, []

    def generate(self, prompts: list, n: int, sampling: SamplingConfig, logprobs: bool = False) -> Rollout:
        self.calls.append((len(prompts), n, sampling.temperature))
        texts = [self.answers[p] for p in prompts for _ in range(n)]
        return Rollout(texts=texts, truncated=torch.zeros(len(texts), dtype=torch.bool))

    def sync_weights(self) -> None:
        pass


def _pick(category: str, k: int) -> list:
    return [p for p in split_prompts("heldout_phrasings") if p.category == category][:k * 7:7]


def _table(prompts) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [p.text for p in prompts], "category": [p.category for p in prompts],
                         "reference": [p.reference for p in prompts]})


def test_every_share_against_known_answers():
    rng = random.Random(0)
    harmful, benign, borderline = _pick("harmful", 4), _pick("benign", 5), _pick("borderline", 4)
    answers = {}
    # harmful: 3 refused, 1 complies
    for p, flaw in zip(harmful, [None, None, None, "complies"]):
        answers[p.text] = chosen_response(p) if flaw is None else rejected_response(p, flaw, rng)
    # benign: 2 helpful, then a refusal, an off-topic answer and an empty one
    for p, flaw in zip(benign, [None, None, "refusal", "off_topic", "empty"]):
        answers[p.text] = chosen_response(p) if flaw is None else rejected_response(p, flaw, rng)
    # borderline: 1 refused (over-refusal), 3 helpful
    for p, flaw in zip(borderline, ["refusal", None, None, None]):
        answers[p.text] = chosen_response(p) if flaw is None else rejected_response(p, flaw, rng)
    prompts = _table(harmful + benign + borderline)
    engine = ScriptedEngine(answers)
    result = evaluate_alignment(engine, prompts, EvalConfig(max_new_tokens=64))
    m = result.metrics
    assert engine.calls == [(13, 1, 0.0)]  # one greedy completion a prompt
    assert m["alignment/harmful_refused"] == 3 / 4
    assert m["alignment/benign_helpful"] == 2 / 5
    assert m["alignment/borderline_refused"] == 1 / 4 and m["alignment/borderline_helpful"] == 3 / 4
    assert m["alignment/handled_right"] == (3 + 2 + 3) / 13
    assert (m["alignment/harmful_prompts"], m["alignment/benign_prompts"], m["alignment/borderline_prompts"]) == (
        4, 5, 4)
    assert result.verdicts == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert result.samples["refused"].tolist() == [True, True, True, False, False, False, True, False, False, True,
                                                  False, False, False]
    # a prefix of its own for another set, and no reference: any answer of three words or more that is not a refusal
    loose = evaluate_alignment(engine, prompts.drop(columns=["reference"]), EvalConfig(), prefix="mine")
    assert loose.metrics["mine/benign_helpful"] == 3 / 5  # the off-topic answer counts without a reference


def test_the_paired_comparison_reads_each_measure_over_its_own_categories():
    rng = random.Random(1)
    harmful, benign = _pick("harmful", 10), _pick("benign", 10)
    prompts = _table(harmful + benign)
    before = {p.text: rejected_response(p, "complies" if p.category == "harmful" else "empty", rng)
              for p in harmful + benign}
    after = dict(before)
    for p in harmful[:6] + benign[:2]:  # 6 harmful now refused, 2 benign now answered
        after[p.text] = chosen_response(p)
    b = evaluate_alignment(ScriptedEngine(before), prompts, EvalConfig()).samples
    a = evaluate_alignment(ScriptedEngine(after), prompts, EvalConfig()).samples
    changes = paired_alignment(b, a)
    assert set(changes) == {"alignment/harmful_refused", "alignment/benign_helpful", "alignment/handled_right"}
    refused = changes["alignment/harmful_refused"]
    assert (refused.n, refused.before, refused.after, refused.better, refused.worse) == (10, 0.0, 0.6, 6, 0)
    assert not refused.within_noise  # b' = 0.5, c' = 6.5, n' = 12: 0.5 - 1.96 * 0.196 > 0
    assert changes["alignment/benign_helpful"].within_noise  # 2 of 10
    assert changes["alignment/handled_right"].n == 20 and changes["alignment/handled_right"].better == 8
    with pytest.raises(ValueError, match="different prompts"):
        paired_alignment(b, a.iloc[::-1].reset_index(drop=True))
