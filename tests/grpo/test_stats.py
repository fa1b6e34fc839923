"""The paired change of a share, against examples worked by hand."""

from __future__ import annotations

import math

import pytest

from grpo.stats import logged_changes, mcnemar_exact, paired_change


def test_the_interval_of_a_worked_example():
    # 10 prompts: 5 right both times, 1 right -> wrong (b), 3 wrong -> right (c), 1 wrong both times.
    # Agresti-Min: b' = 1.5, c' = 3.5, n' = 12; d = (3.5 - 1.5) / 12 = 0.16667;
    # var = ((1.5 + 3.5) - 2**2 / 12) / 12**2 = 4.66667 / 144 = 0.032407; half = 1.95996 * 0.180021 = 0.352834
    before = [True] * 5 + [True] + [False] * 3 + [False]
    after = [True] * 5 + [False] + [True] * 3 + [False]
    c = paired_change(before, after)
    assert (c.n, c.before, c.after, c.worse, c.better) == (10, 0.6, 0.8, 1, 3)
    assert c.low == pytest.approx(0.166667 - 0.352834, abs=1e-5)
    assert c.high == pytest.approx(0.166667 + 0.352834, abs=1e-5)
    # McNemar: 4 discordant pairs, min(b, c) = 1: 2 * (1 + 4) / 16 = 0.625
    assert c.p_value == pytest.approx(0.625) and c.within_noise
    assert c.describe() == "0.600 -> 0.800 (+0.200, 95% CI -0.186..+0.520, p 0.625, n 10), within noise"


def test_a_large_consistent_change_is_beyond_noise_and_a_fall_is_negative():
    up = paired_change([False] * 100, [True] * 30 + [False] * 70)
    # b' = 0.5, c' = 30.5, n' = 102: d = 0.29412, var = (31 - 900/102) / 102**2 = 0.0021315, half = 0.090487
    assert up.low == pytest.approx(0.29412 - 0.090487, abs=1e-4) and not up.within_noise
    assert up.p_value == pytest.approx(2 / 2 ** 30)
    down = paired_change([True] * 30 + [False] * 70, [False] * 100)
    assert down.high == pytest.approx(-up.low, abs=1e-9) and down.change == pytest.approx(-0.3)


def test_no_discordant_pair_still_has_an_interval_around_zero():
    c = paired_change([True, False] * 20, [True, False] * 20)
    # b' = c' = 0.5, n' = 42: d = 0, var = 1 / 42**2, half = 1.95996 / 42
    assert c.low == pytest.approx(-1.959964 / 42) and c.high == pytest.approx(1.959964 / 42)
    assert c.p_value == 1.0 and c.within_noise


def test_mcnemar_exact_against_the_binomial_tail():
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 2 ** 10)  # 0.021484
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)


def test_mismatched_or_empty_verdicts_are_refused():
    with pytest.raises(ValueError, match="same prompts"):
        paired_change([True], [True, False])
    with pytest.raises(ValueError, match="at least one prompt"):
        paired_change([], [])


def test_the_summary_reads_back_what_a_stage_logged():
    c = paired_change([False] * 10 + [True] * 10, [True] * 20)
    metrics = {"alignment/handled_right_before": c.before, "alignment/handled_right": c.after,
               "alignment/handled_right_ci_low": c.low, "alignment/handled_right_ci_high": c.high,
               "alignment/handled_right_p": c.p_value, "alignment/handled_right_n": float(c.n), "eval/accuracy": 0.5}
    assert logged_changes(metrics) == {"alignment/handled_right": c.describe()}
    del metrics["alignment/handled_right_p"]  # an incomplete record is not described
    assert logged_changes(metrics) == {} and not math.isnan(c.low)


def test_the_interval_holds_the_change_itself_on_every_table_up_to_30_prompts():
    # the centre (c - b) / (n + 2) is the change k / n (k = c - b) pulled towards 0 by 2|k| / (n (n + 2)); times
    # (n + 2), the half-width is 1.96 sqrt(b + c + 1 - k^2 / (n + 2)) >= 1.96 sqrt(1 + 2|k| / (n + 2)) (b + c >= |k|,
    # |k| <= n) > 2|k| / n for n >= 1, the pull times (n + 2): the interval always reaches past the change
    for n in range(1, 31):
        for worse in range(n + 1):
            for better in range(n + 1 - worse):
                c = paired_change([True] * worse + [False] * (n - worse),
                                  [False] * worse + [True] * better + [False] * (n - worse - better))
                assert c.low <= c.change <= c.high, (n, worse, better, c)
