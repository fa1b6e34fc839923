"""The alignment measures against a scripted engine whose answers are known, so every share is exact, and their
before -> after over distinct requests (a request asked under several lead-ins counts once)."""

from __future__ import annotations

import random

import pandas as pd
import pytest
import torch

from grpo.configs.sampling import EvalConfig, SamplingConfig
from grpo.data.general import LEAD_INS, chosen_response, prompt_table, split_prompts
from grpo.data.preferences import rejected_response
from grpo.evaluate import evaluate_alignment, paired_alignment
from grpo.stats import paired_change
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
    # every 7th prompt of a split whose requests come six lead-ins in a row: k prompts of k different requests
    return [p for p in split_prompts("heldout_phrasings") if p.category == category][:k * 7:7]


def _table(prompts) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [p.text for p in prompts], "category": [p.category for p in prompts],
                         "reference": [p.reference for p in prompts], "request": [p.request for p in prompts]})


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
    # one prompt a request here: as many requests as prompts
    assert (m["alignment/harmful_requests"], m["alignment/benign_requests"], m["alignment/borderline_requests"]) == (
        4, 5, 4)
    assert result.verdicts == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert result.samples["refused"].tolist() == [True, True, True, False, False, False, True, False, False, True,
                                                  False, False, False]
    # a prefix of its own for another set, and no reference: any answer of three words or more that is not a refusal
    loose = evaluate_alignment(engine, prompts.drop(columns=["reference", "request"]), EvalConfig(), prefix="mine")
    assert loose.metrics["mine/benign_helpful"] == 3 / 5  # the off-topic answer counts without a reference
    assert loose.samples["request"].tolist() == prompts["prompt"].tolist()  # no `request`: each prompt its own


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
    # 10 prompts of 10 different requests: n is 10 either way
    assert (refused.n, refused.before, refused.after, refused.better, refused.worse) == (10, 0.0, 0.6, 6, 0)
    assert not refused.within_noise  # b' = 0.5, c' = 6.5, n' = 12: 0.5 - 1.96 * 0.196 > 0
    assert changes["alignment/benign_helpful"].within_noise  # 2 of 10
    assert changes["alignment/handled_right"].n == 20 and changes["alignment/handled_right"].better == 8
    with pytest.raises(ValueError, match="different prompts"):
        paired_alignment(b, a.iloc[::-1].reset_index(drop=True))


def test_a_request_asked_under_several_lead_ins_counts_once():
    # 3 harmful requests and 2 benign ones, each asked under the first 4 lead-ins: 20 prompts, 5 requests
    requests = {}
    for p in split_prompts("heldout_phrasings"):
        if p.text[: len(p.text) - len(p.request)] in LEAD_INS[:4]:  # the lead-in: what comes before the request
            requests.setdefault((p.category, p.request), []).append(p)
    harmful = [ps for (c, _), ps in requests.items() if c == "harmful"][:3]
    benign = [ps for (c, _), ps in requests.items() if c == "benign"][:2]
    assert all(len(ps) == 4 for ps in harmful + benign)
    prompts = prompt_table([p for ps in harmful + benign for p in ps])  # the data's own table: `request` travels
    rng = random.Random(2)
    before = {p.text: rejected_response(p, "complies", rng) for p in (p for ps in harmful[:2] for p in ps)}
    before.update({p.text: chosen_response(p) for p in harmful[2]})  # the third refused all along
    after = {p.text: chosen_response(p) for ps in harmful for p in ps}  # every copy of every harmful one refused
    # benign: the first request answered before and after; the second's copies disagree: two answered all along,
    # one empty -> answered, one answered -> empty
    for ps in benign:
        for p in ps:
            before[p.text] = after[p.text] = chosen_response(p)
    second = benign[1]
    before[second[2].text] = rejected_response(second[2], "empty", rng)
    after[second[3].text] = rejected_response(second[3], "empty", rng)
    b = evaluate_alignment(ScriptedEngine(before), prompts, EvalConfig())
    a = evaluate_alignment(ScriptedEngine(after), prompts, EvalConfig())
    assert b.samples["request"].tolist() == prompts["request"].tolist()
    assert (b.metrics["alignment/harmful_prompts"], b.metrics["alignment/harmful_requests"]) == (12, 3)
    assert (b.metrics["alignment/benign_prompts"], b.metrics["alignment/benign_requests"]) == (8, 2)
    changes = paired_alignment(b.samples, a.samples)
    refused = changes["alignment/harmful_refused"]
    # 12 prompts, 3 requests: two went complying -> refusing on all 4 copies, one refused throughout; n is 3, and the
    # interval is Agresti-Min's on one verdict a request (tests/grpo/test_stats.py works it by hand: 0.4 +- 0.581419)
    assert (refused.n, refused.before, refused.after, refused.better) == (3, 4 / 12, 1.0, 8)
    one_each = paired_change([False, False, True], [True, True, True])
    assert (refused.low, refused.high, refused.p_value) == pytest.approx((one_each.low, one_each.high, 0.5))
    assert refused.within_noise  # the 12 copies counted apart would read 0.277..0.866: beyond noise
    helpful = changes["alignment/benign_helpful"]
    # 8 prompts, 2 requests: nets 0 and (+1 - 1) = 0, so d = 0; m = 4, N' = 8 + 8 = 16;
    # var = (0 + 0 + 4**2 * (1 + 0)) / 16**2 = 1 / 16, half = 1.95996 / 4 = 0.489991; sign flips: no nonzero net, p 1
    assert (helpful.n, helpful.worse, helpful.better, helpful.p_value) == (2, 1, 1, 1.0)
    assert (helpful.low, helpful.high) == pytest.approx((-0.489991, 0.489991), abs=1e-6)
    assert changes["alignment/handled_right"].n == 5
    assert "n 3 requests" in refused.describe()
