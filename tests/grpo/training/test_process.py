"""Process supervision's token advantages against hand-worked numbers and a naive loop, and the loss that takes them."""

import math
import random
import statistics

import pytest
import torch

from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.models import load_tokenizer
from grpo.rewards.steps import Steps
from grpo.training.advantages import group_advantages
from grpo.training.loss import grpo_loss
from grpo.training.process import (
    char_to_token_ends,
    process_advantages,
    step_metrics,
    step_rewards,
    token_char_ends,
)


def naive_process_advantages(step_rewards, step_ends, G, width, scale="group", eps=1e-4):
    """The notes' formula, literally: r~ = (r - mean(R)) / std(R) over the group's steps R, and
    A_t = sum of r~_j over the completion's steps j with index(j) >= t."""
    everything = [r for rs in step_rewards for r in rs]
    batch_std = statistics.stdev(everything) if len(everything) > 1 else 0.0
    out = [[0.0] * width for _ in step_rewards]
    for g in range(len(step_rewards) // G):
        rows = range(g * G, (g + 1) * G)
        R = [r for i in rows for r in step_rewards[i]]
        if not R:
            continue
        mean = sum(R) / len(R)
        std = {"group": statistics.stdev(R) if len(R) > 1 else 0.0, "batch": batch_std, "none": None}[scale]
        for i in rows:
            for t in range(width):
                for r, end in zip(step_rewards[i], step_ends[i]):
                    if end >= t:
                        out[i][t] += (r - mean) if std is None else (r - mean) / (std + eps)
    return torch.tensor(out)


def test_hand_worked_group():
    # one group of two: completion 0 has steps r = [1, 0, 1] ending at tokens 0, 2, 3; completion 1 r = [1, 1] at 1, 3
    # R = {1, 0, 1, 1, 1}: mean 0.8, squared deviations .04 + .64 + .04 + .04 + .04 = .8, unbiased var .2,
    # std 0.44721. r~ of a 1: 0.2 / 0.44721 = a = 0.44721; of the 0: -0.8 / 0.44721 = b = -1.78885
    # completion 0: A_0 = a + b + a = -0.89443, A_1 = A_2 = b + a = -1.34164, A_3 = a = 0.44721
    # completion 1: A_0 = A_1 = a + a = 0.89443, A_2 = A_3 = a = 0.44721
    adv = process_advantages([[1.0, 0.0, 1.0], [1.0, 1.0]], [[0, 2, 3], [1, 3]], 2, 4, eps=0.0)
    a, b = 0.2 / math.sqrt(0.2), -0.8 / math.sqrt(0.2)
    expected = torch.tensor([[2 * a + b, a + b, a + b, a], [2 * a, 2 * a, a, a]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(expected, torch.tensor([[-0.89443, -1.34164, -1.34164, 0.44721],
                                                       [0.89443, 0.89443, 0.44721, 0.44721]]), atol=1e-5, rtol=0)


def test_tokens_after_the_last_step_get_nothing_and_a_stepless_row_gets_zeros():
    # group [r=[2] at token 1], [no steps]: R = {2}, one step: std 0 -> r~ = 0 / eps = 0 everywhere
    adv = process_advantages([[2.0], []], [[1], []], 2, 3)
    torch.testing.assert_close(adv, torch.zeros(2, 3))
    # scale none: mean 1.5 over R = {2, 1}; row 0 r~ = 0.5 up to token 1, row 1 r~ = -0.5 up to token 0
    adv = process_advantages([[2.0], [1.0]], [[1], [0]], 2, 3, scale="none")
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_the_naive_loop_on_random_ragged_steps(scale):
    rng = random.Random(scale)
    for _ in range(20):
        G, groups, width = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 7)
        rewards, ends = [], []
        for _ in range(G * groups):
            k = rng.randint(0, 4)
            ends.append(sorted(rng.randrange(width) for _ in range(k)))  # two steps may end in the same token
            rewards.append([rng.choice([0.0, 0.5, 1.0, 1.5]) for _ in range(k)])
        got = process_advantages(rewards, ends, G, width, scale=scale)
        torch.testing.assert_close(got, naive_process_advantages(rewards, ends, G, width, scale), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_one_step_per_completion_is_outcome_grpo(scale):
    # each completion's only step ends at its last token: every token gets the outcome advantage, padding none
    torch.manual_seed(0)
    G, width = 4, 6
    rewards = torch.randint(0, 3, (3 * G,)).float() / 2  # [N] in {0, .5, 1}
    lengths = torch.randint(1, width + 1, (3 * G,))  # [N]
    adv = process_advantages([[r] for r in rewards.tolist()], [[n - 1] for n in lengths.tolist()], G, width,
                             scale=scale)  # [N, C]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()  # [N, C]
    outcome = group_advantages(rewards, G, scale=scale)  # [N]
    torch.testing.assert_close(adv, outcome[:, None] * mask)


def test_bad_steps_fail_with_the_completion_named():
    with pytest.raises(ValueError, match=r"completion 1: step ends \[5\] lie outside the 4"):
        process_advantages([[1.0], [1.0]], [[0], [5]], 2, 4)
    with pytest.raises(ValueError, match="completion 0: 2 step rewards for 1 step ends"):
        process_advantages([[1.0, 0.0], [1.0]], [[0], [1]], 2, 4)
    with pytest.raises(ValueError, match="not whole groups"):
        process_advantages([[1.0]] * 3, [[0]] * 3, 2, 4)


def test_the_answer_step_carries_the_outcome_and_stepless_completions_fall_back():
    # token k of the completion brings its text to token_chars[k] characters; steps end at characters 4 and 9
    steps = [Steps((4, 9), (1.0, 0.0)), Steps()]
    result = step_rewards(steps, [1.5, 0.5], [[2, 4, 7, 9, 12, 12], [3, 6, 6]])
    assert result.ends == [[1, 3, 5], [2]]  # the answer step ends at the last token (the end-of-turn)
    assert result.rewards == [[1.0, 0.0, 1.5], [0.5]]
    assert result.checked == [2, 0]
    assert step_metrics(result) == {"process/steps_per_completion": 1.0, "process/step_accuracy": 0.5,
                                    "process/fallback": 1.0, "reward_ungraded/step_verifier/raised": 0.0,
                                    "reward_ungraded/step_verifier/malformed": 0.0}


def test_a_step_verifier_that_raises_on_a_completion_leaves_it_ungraded_and_checks_the_others():
    from grpo.training.process import score_steps

    def picky(texts, **_):
        if any("boom" in t for t in texts):
            raise RuntimeError("the verifier's model is gone")
        return [Steps((2,), (1.0,)) for _ in texts]

    result = score_steps(picky, ["ok text", "boom", "fine"], {}, [1.0, 0.0, 1.0], [[2, 4, 7], [3, 4], [2, 4]])
    assert result.ungraded == [None, "raised", None] and result.checked == [1, 0, 1]
    assert step_metrics(result)["reward_ungraded/step_verifier/raised"] == 1.0


def test_a_malformed_step_verifier_answer_leaves_its_completion_ungraded_not_the_stage_failed():
    """Steps out of order, ends and rewards of different lengths, a NaN reward, something that is not Steps: each
    such completion is ungraded for `malformed` (no steps, no reward), the others checked; the wrong number of
    answers leaves every completion ungraded."""
    from grpo.training.process import score_steps

    answers = {"order": Steps((5, 3), (1.0, 1.0)), "lengths": Steps((5,), (1.0, 0.0)),
               "nan": Steps((2,), (math.nan,)), "none": None, "fine": Steps((2,), (1.0,))}

    def verifier(texts, **_):
        return [answers[t] for t in texts]

    texts = list(answers)
    chars = [[2, 4, 7]] * len(texts)
    result = score_steps(verifier, texts, {}, [1.0] * len(texts), chars)
    assert result.ungraded == ["malformed"] * 4 + [None] and result.checked == [0, 0, 0, 0, 1]
    metrics = step_metrics(result)
    assert metrics["reward_ungraded/step_verifier/malformed"] == 4.0 and metrics["process/fallback"] == 0.0
    short = score_steps(lambda texts, **_: [Steps()], ["a", "b"], {}, [1.0, 0.0], [[1], [1]])
    assert short.ungraded == ["malformed", "malformed"]


def test_step_ends_map_to_the_token_that_holds_their_last_character():
    assert char_to_token_ends([1, 2, 3, 5, 99], [2, 3, 5]) == [0, 0, 1, 2, 2]
    tok = load_tokenizer(ModelConfig(tiny=TinyModelConfig()))
    text = "<think>Given 4, 5. 4 + 5 = 9. 9 - 2 = 7.</think><answer>7</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids_t = torch.tensor([ids + [tok.pad_token_id] * 2])  # [1, C] right-padded
    mask = torch.tensor([[1] * len(ids) + [0, 0]])
    (chars,) = token_char_ends(tok, ids_t, mask, [text])
    assert chars[-1] == len(text) and len(chars) == len(ids)  # the end-of-turn token adds no text
    for end in (text.index("9.") + 2, text.index("7.") + 2):
        (k,) = char_to_token_ends([end], chars)
        assert tok.decode(ids[: k + 1]).startswith(text[:end])  # the step is whole by its end token...
        assert not tok.decode(ids[:k]).startswith(text[:end])  # ...and not before it


LOSS_TYPES = ["grpo", "bnpo", "dapo", "dr_grpo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_with_the_same_advantage_on_every_token_is_the_sequence_loss(loss_type):
    torch.manual_seed(1)
    B, T = 3, 5
    logps = (-torch.rand(B, T)).requires_grad_()
    old, ref = -torch.rand(B, T), -torch.rand(B, T)
    adv = torch.randn(B)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).float()
    a, stats_a = grpo_loss(logps, old, ref, adv, mask, loss_type=loss_type)
    (ga,) = torch.autograd.grad(a, logps)
    b, stats_b = grpo_loss(logps, old, ref, adv[:, None].expand(B, T), mask, loss_type=loss_type)
    (gb,) = torch.autograd.grad(b, logps)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)
    assert stats_a == stats_b


def test_loss_with_token_advantages_hand_worked():
    # one sequence, two tokens, beta 0. Token 0: ratio e^0.5 = 1.65 > 1.2 with A = +2 -> clipped, -1.2 * 2 = -2.4,
    # no gradient. Token 1: ratio 1, A = -1 -> -(1 * -1) = +1, gradient d/dlogp (-ratio * A) = -A = +1.
    # grpo: mean of the sequence's token mean: (-2.4 + 1) / 2 = -0.7; gradient [0, 1/2]
    logps = torch.tensor([[0.5, 0.0]], requires_grad=True)
    loss, stats = grpo_loss(logps, torch.zeros(1, 2), None, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), beta=0.0)
    (grad,) = torch.autograd.grad(loss, logps)
    assert round(loss.item(), 4) == -0.7
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.5]]))
    assert stats["clip_ratio/high"] == 0.5


def test_loss_refuses_token_advantages_of_the_wrong_shape_or_with_sequence_ratios():
    logps, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]=\(2,\) or, one a token, \[B, T\]=\(2, 3\)"):
        grpo_loss(logps, None, None, torch.zeros(2, 4), mask, beta=0.0)
    with pytest.raises(ValueError, match="need importance_sampling_level 'token'"):
        grpo_loss(logps, None, None, torch.zeros(2, 3), mask, beta=0.0, importance_sampling_level="sequence")
