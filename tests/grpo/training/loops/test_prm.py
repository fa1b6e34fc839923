"""The process reward model: trained on step labels, its step scores tell good steps from bad on held-out ones; its
rows packed give the padded numbers (float32, one thread, bounds relative to the values)."""

import pandas as pd
import pytest
import torch

from comparisons import close
from grpo.configs.data import TaskConfig
from grpo.configs.model import ModelConfig
from grpo.configs.reward import RewardModelConfig
from grpo.data.arithmetic import generate_problems
from grpo.rewards.steps import arithmetic_steps
from grpo.training.loops.prm import _auc, build_prm, evaluate_prm, label_worked_solutions, prm_step_verifier, train_prm
from tiny_configs import SMALL

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


def test_a_trained_prm_scores_held_out_steps_as_a_step_verifier(tmp_path):
    # How well it learns is a figure (benchmarks/quality_claims.py): at this size and budget the PRM learns mostly
    # where bad steps sit (after a first error, every step is bad), little of the arithmetic itself: measured, AUC
    # 0.59-0.63 overall and 0.52-0.56 among steps of one position. Here: it moves the right way and, as a step
    # verifier, scores each step of the rule's with P(good)
    train = label_worked_solutions(generate_problems(TASK, 300, "train"), seed=0)
    heldout = label_worked_solutions(generate_problems(TASK, 100, "heldout"), seed=1)
    cfg = RewardModelConfig(model=SMALL, max_steps=150, batch_size=32, learning_rate=3e-3, warmup_steps=10,
                            mixed_precision="no", log_every=50)
    untrained, tok = build_prm(SMALL)
    before = evaluate_prm(untrained, tok, heldout)["prm/heldout_auc"]
    result = train_prm(train, cfg, tmp_path, heldout=heldout)
    assert result.heldout["prm/heldout_auc"] > before, (before, result.heldout)
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


# -- packed rows -----------------------------------------------------------------------------------------------------

def prm_without_dropout(folder) -> ModelConfig:
    """The tiny PRM saved with its head's dropout off (transformers' token classifiers drop 10% by default), so a
    packed and a padded training step draw no different masks."""
    model, tok = build_prm(SMALL)
    model.config.classifier_dropout = 0.0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return ModelConfig(name_or_path=str(folder))


@pytest.mark.parametrize("kernel", [True, False])
def test_packed_step_logits_and_gradients_equal_the_padded_ones(tmp_path, kernel):
    """Rows of uneven lengths with steps ending anywhere (the first token, the last) read packed, through the packed
    kernel or transformers' mask from the position ids: the padded logits, and the same gradients."""
    from grpo.kernels.attention import attending_packed
    from grpo.training.loops.prm import step_logits

    from grpo.training.reward_scorer import packs

    model, tok = build_prm(prm_without_dropout(tmp_path))
    assert packs("auto", model)  # a Qwen2 token classifier on CPU takes the packed kernel
    with torch.no_grad():  # a fresh head gives near-0 logits everywhere: make them differ
        model.score.weight.mul_(20.0)
    model.train()
    g = torch.Generator().manual_seed(4)
    rows = [(torch.randint(1, 200, (n,), generator=g).tolist(), ends)
            for n, ends in ((9, [2, 8]), (1, [0]), (14, [0, 5, 6, 13]), (5, []), (11, [10]))]
    weights = torch.randn(sum(len(e) for _, e in rows), generator=g)  # [S]
    out = {}
    for packed in (False, True):
        model.zero_grad()
        with attending_packed(model, packed and kernel):
            logits = step_logits(model, rows, tok.pad_token_id, torch.device("cpu"),
                                 packed_for=model if packed else None)  # [S]
        (logits * weights).sum().backward()
        out[packed] = logits, [p.grad.clone() for p in model.parameters()]
    assert out[False][0].std() > 0.1  # logits that differ, so a shifted read would show
    assert close(out[True][0], out[False][0])
    assert all(close(a, b, 1e-4) for a, b in zip(out[True][1], out[False][1]))


def test_a_short_prm_run_packed_matches_the_padded_one(tmp_path):
    """Three steps of 8 rows: the same losses, held-out figures and weights as the padded run."""
    from transformers import AutoModelForTokenClassification

    model_cfg = prm_without_dropout(tmp_path / "start")
    train = label_worked_solutions(generate_problems(TASK, 12, "train"), seed=0)
    heldout = label_worked_solutions(generate_problems(TASK, 6, "heldout"), seed=1)
    runs = {}
    for packing in (False, True):
        cfg = RewardModelConfig(model=model_cfg, max_steps=3, batch_size=8, learning_rate=1e-3, warmup_steps=0,
                                mixed_precision="no", log_every=1, packing=packing)
        seen = {}
        result = train_prm(train, cfg, tmp_path / str(packing), lambda s, m: seen.setdefault(s, {}).update(m),
                           heldout=heldout)
        runs[packing] = seen, AutoModelForTokenClassification.from_pretrained(result.model_dir).state_dict()
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    for step in (1, 2, 3):
        assert packed[step]["prm/loss"] == pytest.approx(padded[step]["prm/loss"], rel=1e-5), step
    for key in ("prm/heldout_auc", "prm/heldout_accuracy"):
        assert packed[3][key] == pytest.approx(padded[3][key], rel=1e-6), key
    # AdamW divides each gradient by its own size, so a rounding-sized difference in a near-zero gradient moves its
    # weight by a share of the learning rate (1e-3), not of the gradient: at most 2% of it
    apart = {n: (w_packed[n] - w).abs().max().item() for n, w in w_padded.items()}
    assert max(apart.values()) <= 2e-5, apart
