"""Which prompts a step takes: uniformly, or a fixed share of each kind every step (`grpo.training.batches`)."""

from __future__ import annotations

import pickle
from collections import Counter

import pandas as pd
import pytest

from grpo.configs.training import GRPOConfig
from grpo.training.batches import PromptOrder, mixed_order, prompt_mix_order, prompt_order

KINDS = ["reasoning"] * 30 + ["general"] * 10


def test_every_step_takes_the_mix_exactly_and_each_kind_walks_its_own_epochs():
    order = mixed_order(KINDS, 8, seed=3, mix={"general": 0.25})
    assert order.counts == (2, 6)
    seen = Counter()
    for step in range(5):  # 5 steps x 2 = 10 general prompts: one epoch of the general rows, each exactly once
        idx = order(step)
        assert len(idx) == len(set(idx)) == 8
        assert Counter(KINDS[i] for i in idx) == {"general": 2, "reasoning": 6}
        seen.update(i for i in idx if KINDS[i] == "general")
    assert sorted(seen) == list(range(30, 40)) and set(seen.values()) == {1}
    assert order(4) == mixed_order(KINDS, 8, seed=3, mix={"general": 0.25})(4)  # a pure function of the step
    assert order(4) != order(4, draw=1)  # a refill draw comes from its own stream
    assert pickle.loads(pickle.dumps(order))(2) == order(2)  # travels to asynchronous samplers
    # the interleaving: the general prompts are not all at one end of the step
    assert any(KINDS[order(s)[0]] == "general" for s in range(20)) and any(
        KINDS[order(s)[-1]] == "general" for s in range(20))


def test_no_mix_is_the_uniform_order_and_bad_mixes_fail_before_sampling():
    assert mixed_order(KINDS, 8, 0, {})(3) == prompt_order(40, 3, 8, 0)
    assert PromptOrder(40, 8, 0)(3, draw=2) == prompt_order(40, 3, 8, 0, 2)
    with pytest.raises(ValueError, match="no prompt row has it"):
        mixed_order(KINDS, 8, 0, {"code": 0.5})
    with pytest.raises(ValueError, match="less than one"):
        mixed_order(KINDS, 8, 0, {"general": 0.05})
    with pytest.raises(ValueError, match="only 10"):
        mixed_order(KINDS, 32, 0, {"general": 0.5})
    with pytest.raises(ValueError, match="make the shares add up to 1"):
        mixed_order(["general"] * 10, 8, 0, {"general": 0.5})
    with pytest.raises(ValueError, match="no `kind` column"):
        prompt_mix_order(pd.DataFrame({"prompt": ["a"] * 8}), GRPOConfig(prompts_per_step=4,
                                                                         prompt_mix={"general": 0.5}))
    with pytest.raises(ValueError, match="add up to more than 1"):
        GRPOConfig(prompt_mix={"general": 0.6, "reasoning": 0.6})
