"""Hand-worked checks of grpo.training.advantages (CPU, no fixtures)."""

import math

import pytest
import torch

from grpo.training.advantages import group_advantages, group_std, zero_std_fraction

EPS = 1e-4
SQRT_HALF = math.sqrt(0.5)  # 0.7071: unbiased std of a pair {0, 1}


def test_group_scale_hand_worked():
    # groups [1, 0] and [0, 1]: means 0.5, 0.5
    # unbiased std of each: sqrt(((0.5)^2 + (0.5)^2) / (2 - 1)) = sqrt(0.5) = 0.7071
    # advantages: ±0.5 / (0.7071 + 1e-4) = ±0.70701
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    a = 0.5 / (SQRT_HALF + EPS)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a]))


def test_group_scale_zero_std_group_gives_zero():
    # group [1, 0] -> ±0.5 / (0.7071 + 1e-4); group [1, 1] -> centered [0, 0] / (0 + 1e-4) = 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
    a = 0.5 / (SQRT_HALF + EPS)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0]))


def test_batch_scale_hand_worked():
    # rewards [1, 0 | 1, 1]: group means 0.5 and 1.0 -> centered [0.5, -0.5, 0, 0]
    # batch mean 0.75; squared deviations .0625 + .5625 + .0625 + .0625 = 0.75
    # unbiased batch var 0.75 / 3 = 0.25 -> std 0.5
    # advantages [0.5, -0.5, 0, 0] / (0.5 + 1e-4)
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, scale="batch")
    a = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0]))


def test_none_scale_only_centers():
    # group [3, 1, 2]: mean 2 -> [1, -1, 0]; group [2, 2, 5]: mean 3 -> [-1, -1, 2]
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 5.0]), 3, scale="none")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, -1.0, -1.0, 2.0]))


def test_custom_eps_is_used():
    # group [1, 0]: ±0.5 / (0.7071 + 0.5)
    adv = group_advantages(torch.tensor([1.0, 0.0]), 2, eps=0.5)
    a = 0.5 / (SQRT_HALF + 0.5)
    torch.testing.assert_close(adv, torch.tensor([a, -a]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_size_one_gives_zero_not_nan(scale):
    # one sample per group: nothing to compare against, so advantage 0 (std of one is NaN in torch)
    adv = group_advantages(torch.tensor([1.0, 0.0, 5.0]), 1, scale=scale)
    torch.testing.assert_close(adv, torch.zeros(3))


def test_single_reward_batch_scale_is_not_nan():
    # batch std of a single element would be NaN; it must be treated as 0
    adv = group_advantages(torch.tensor([3.0]), 1, scale="batch")
    torch.testing.assert_close(adv, torch.zeros(1))


def test_shape_and_dtype_preserved():
    r = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 0.0], dtype=torch.float64)
    adv = group_advantages(r, 3)
    assert adv.shape == (6,)
    assert adv.dtype == torch.float64


@pytest.mark.parametrize("n, group_size", [(5, 2), (3, 4), (4, 0)])
def test_bad_length_or_group_size_raises(n, group_size):
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(n), group_size)


def test_unknown_scale_raises():
    with pytest.raises(ValueError, match="group"):
        group_advantages(torch.zeros(4), 2, scale="std")


def test_group_std_is_unbiased():
    # [1, 0]: sqrt(0.5 / 1) = 0.7071; [2, 2]: 0; [0, 4]: mean 2, sq devs 4 + 4 = 8, sqrt(8 / 1) = 2.8284
    # (a biased std would give 0.5 and 2.0)
    std = group_std(torch.tensor([1.0, 0.0, 2.0, 2.0, 0.0, 4.0]), 2)
    torch.testing.assert_close(std, torch.tensor([SQRT_HALF, 0.0, math.sqrt(8.0)]))


def test_group_std_of_singletons_is_zero():
    torch.testing.assert_close(group_std(torch.tensor([1.0, 7.0]), 1), torch.zeros(2))


def test_zero_std_fraction():
    # groups [1, 1] agree, [0, 1] differ, [0.5, 0.5] agree -> 2 of 3
    frac = zero_std_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2)
    assert frac == pytest.approx(2 / 3)


def test_zero_std_fraction_all_differ_and_all_agree():
    assert zero_std_fraction(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2) == 0.0
    assert zero_std_fraction(torch.tensor([0.3, 0.3, 0.3]), 3) == 1.0


def test_zero_std_fraction_bad_length_raises():
    with pytest.raises(ValueError):
        zero_std_fraction(torch.zeros(5), 2)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_over_graded_rows_equal_the_formula_on_those_rows(scale):
    """Ungraded rows (no reward could be had) are left out of their group's statistics and get 0; a group with one
    graded row has nothing to compare against and gets 0 everywhere; all graded, the mask changes nothing."""
    from grpo.training.advantages import trained_rows

    torch.manual_seed(0)
    rewards = torch.randn(12)
    graded = torch.tensor([1, 1, 0, 1,  0, 0, 1, 0,  1, 1, 1, 1], dtype=torch.bool)  # groups of 4
    out = group_advantages(rewards, 4, scale=scale, graded=graded)
    kept = [0, 1, 3, 8, 9, 10, 11]
    # the formula by hand, over the graded rows of the groups that have two or more of them
    expected = torch.zeros(12)
    spread = rewards[kept].std() if scale == "batch" else None
    for rows in ([0, 1, 3], [8, 9, 10, 11]):
        values = rewards[rows]
        centered = values - values.mean()
        expected[rows] = centered / (values.std() + 1e-4) if scale == "group" else (
            centered / (spread + 1e-4) if scale == "batch" else centered)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)
    assert trained_rows(graded.tolist(), 4).tolist() == [True, True, False, True] + [False] * 4 + [True] * 4
    assert torch.equal(group_advantages(rewards, 4, scale=scale, graded=torch.ones(12, dtype=torch.bool)),
                       group_advantages(rewards, 4, scale=scale))
