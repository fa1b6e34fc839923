"""The process reward model: trained on step labels, its step scores tell good steps from bad on held-out ones."""

import pandas as pd
import pytest
import torch

from grpo.config import ModelConfig, TaskConfig, TinyModelConfig
from grpo.reward_config import RewardModelConfig
from grpo.data.arithmetic import generate_problems
from grpo.rewards.steps import arithmetic_steps
from grpo.training.loops.prm import _auc, build_prm, evaluate_prm, label_worked_solutions, prm_step_verifier, train_prm

SMALL = ModelConfig(tiny=TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
TASK = TaskConfig(max_operand=5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small train faster on one thread; on a busy 2-core machine two threads that wait on each other
    run 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_perfect_rollout_labels_mark_the_corrupted_step_and_what_follows():
    labelled = label_worked_solutions(generate_problems(TASK, 20, "train"))
    assert len(labelled) == 40
    for row in labelled.itertuples():
        checked = arithmetic_steps([row.completion])[0]
        assert row.step_ends == list(checked.ends)
        # a worked solution's steps hold; the first bad label is the step whose arithmetic is wrong, the rest follow
        first_bad = row.labels.index(0) if 0 in row.labels else None
        assert checked.rewards == tuple(0.0 if j == first_bad else 1.0 for j in range(len(row.labels)))
        assert row.labels == sorted(row.labels, reverse=True)


def test_auc_is_the_chance_a_good_step_outscores_a_bad_one():
    assert _auc([0.9, 0.2, 0.5, 0.5], [1, 0, 1, 0]) == pytest.approx((1 + 1 + 1 + 0.5) / 4)


def test_a_trained_prm_beats_chance_on_held_out_steps(tmp_path):
    # 100 held-out problems, 200 rows, 400 steps: an AUC of chance (0.5) has a std of about 0.03 on them. At this
    # size and budget the PRM learns mostly where bad steps sit (after a first error, every step is bad), little of
    # the arithmetic itself: measured, AUC 0.59-0.63 overall and 0.52-0.56 among steps of one position
    train = label_worked_solutions(generate_problems(TASK, 300, "train"), seed=0)
    heldout = label_worked_solutions(generate_problems(TASK, 100, "heldout"), seed=1)
    cfg = RewardModelConfig(model=SMALL, max_steps=150, batch_size=32, learning_rate=3e-3, warmup_steps=10,
                            mixed_precision="no", log_every=50)
    untrained, tok = build_prm(SMALL)
    before = evaluate_prm(untrained, tok, heldout)["prm/heldout_auc"]
    result = train_prm(train, cfg, tmp_path, heldout=heldout)
    assert result.heldout["prm/heldout_auc"] > max(0.57, before + 0.05), (before, result.heldout)
    # as a step verifier: the rule's steps, each rewarded with P(good)
    verify = prm_step_verifier(result.model_dir)
    steps = verify(heldout["completion"].tolist(), prompts=heldout["prompt"].tolist())
    assert [list(s.ends) for s in steps] == heldout["step_ends"].tolist()
    scores = pd.DataFrame({"p": [p for s in steps for p in s.rewards],
                           "label": [y for ys in heldout["labels"] for y in ys]})
    assert scores["p"].between(0, 1).all()
    assert scores.groupby("label")["p"].mean()[1] > scores.groupby("label")["p"].mean()[0]
    with pytest.raises(ValueError, match="reads the question"):
        verify(["<think>1 + 1 = 2.</think>"])
