"""The paired change of a share, against examples worked by hand: prompts each their own request, then requests
asked several times (the lead-ins of the synthetic general prompts), counted once."""

from __future__ import annotations

import math

import pytest

from grpo.stats import logged_changes, mcnemar_exact, paired_change, sign_flip_p


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
    # every prompt its own request: n counts them, 10
    assert c.describe() == "0.600 -> 0.800 (+0.200, 95% CI -0.186..+0.520, p 0.625, n 10 requests), within noise"
    assert paired_change(before, after, requests=list("abcdefghij")) == c  # distinct requests: the same


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


def test_the_sign_flip_test_is_mcnemars_with_one_prompt_a_request():
    # nets of +1 (wrong -> right) c times and -1 b times: the sign patterns' sum is 2K - (b + c), K ~ Binomial(b + c,
    # 1/2), as far from zero as |c - b| when K <= min(b, c) or K >= max(b, c): McNemar's two tails
    for worse in range(6):
        for better in range(6):
            assert sign_flip_p([1] * better + [-1] * worse + [0] * 3) == pytest.approx(mcnemar_exact(worse, better))
    # nets 3 and -1: patterns +4, +2, -2, -4; |sum| >= 2 in all four
    assert sign_flip_p([3, -1]) == 1.0
    # nets 3, 1, 1: patterns sum to 3 +- 1 +- 1 = 5, 3, 3, 1 and their negatives; |sum| >= 5 in two of eight
    assert sign_flip_p([3, 1, 1]) == pytest.approx(2 / 8)


# 3 requests asked 4 times each (the lead-ins), in the order a, b, c, a, b, c, ...: copies need not be adjacent
REQUESTS = list("abc") * 4


def _by_request(verdicts: dict[str, list[bool]]) -> list[bool]:
    """Each request's four copies' verdicts laid out in REQUESTS' order."""
    return [verdicts[r][i // 3] for i, r in enumerate(REQUESTS)]


def test_copies_that_move_together_count_once():
    # a and b: all four copies wrong -> right; c: all four right both times
    before = _by_request({"a": [False] * 4, "b": [False] * 4, "c": [True] * 4})
    after = _by_request({"a": [True] * 4, "b": [True] * 4, "c": [True] * 4})
    c = paired_change(before, after, REQUESTS)
    # the shares stay shares of prompts: 4 / 12 right before, 12 / 12 after; 8 prompts went better
    assert (c.n, c.before, c.after, c.worse, c.better) == (3, 4 / 12, 1.0, 0, 8)
    # by request: N = 12 prompts, J = 3, m = 4; half a request (2 prompts) in each cell: N' = 12 + 8 = 20,
    # d = 8 / 20 = 0.4; nets (+4, +4, 0): sum (net - d * 4)**2 = 2.4**2 + 2.4**2 + 1.6**2 = 14.08;
    # the half-requests' own: 4**2 * (1 + 2 * 0.16) = 21.12; var = (14.08 + 21.12) / 20**2 = 0.088;
    # half = 1.95996 * 0.296648 = 0.581419
    assert c.low == pytest.approx(0.4 - 0.581419, abs=1e-5) and c.high == pytest.approx(0.4 + 0.581419, abs=1e-5)
    # the sign flips of nets +4, +4 sum to +8, 0, 0, -8: two of four as far as 8
    assert c.p_value == pytest.approx(0.5) and c.within_noise
    # the same as Agresti-Min and McNemar on one verdict a request: b' = 0.5, c' = 2.5, n' = 5, d = 2 / 5 = 0.4,
    # var = (3 - 2**2 / 5) / 5**2 = 0.088; McNemar(0, 2) = 2 * 1 / 4 = 0.5
    one_each = paired_change([False, False, True], [True, True, True])
    assert (one_each.n, one_each.p_value) == (3, c.p_value)
    assert (one_each.low, one_each.high) == pytest.approx((c.low, c.high))
    # counting the 12 copies as independent prompts claims a result: b' = 0.5, c' = 8.5, n' = 14, d = 0.571429,
    # var = (9 - 8**2 / 14) / 14**2 = 0.022595, half = 0.294613: 0.277..0.866, and McNemar(0, 8) = 2 / 2**8
    copies = paired_change(before, after)
    assert copies.n == 12 and copies.low == pytest.approx(0.571429 - 0.294613, abs=1e-5)
    assert copies.p_value == pytest.approx(2 / 256) and not copies.within_noise
    assert c.high - c.low > copies.high - copies.low
    assert c.describe().endswith("p 0.5, n 3 requests), within noise")


def test_copies_that_disagree_count_by_their_net_change():
    # a: all four wrong -> right (net +4); b: two wrong -> right, one right -> wrong, one right both times (net +1);
    # c: one right -> wrong, three wrong both times (net -1)
    before = _by_request({"a": [False] * 4, "b": [False, False, True, True], "c": [True, False, False, False]})
    after = _by_request({"a": [True] * 4, "b": [True, True, False, True], "c": [False] * 4})
    c = paired_change(before, after, REQUESTS)
    # right before: b's two, c's one = 3 / 12; after: a's four, b's three = 7 / 12; 6 prompts better, 2 worse
    assert (c.n, c.before, c.after, c.worse, c.better) == (3, 3 / 12, 7 / 12, 2, 6)
    # N' = 20, d = (6 - 2) / 20 = 0.2; nets minus d * 4 = 0.8: 3.2**2 + 0.2**2 + (-1.8)**2 = 13.52; the half-requests'
    # own 16 * (1 + 2 * 0.04) = 17.28; var = 30.8 / 400 = 0.077; half = 1.95996 * 0.277489 = 0.543868
    assert c.low == pytest.approx(0.2 - 0.543868, abs=1e-5) and c.high == pytest.approx(0.2 + 0.543868, abs=1e-5)
    # sign flips of nets 4, 1, -1: sums 4 +- 1 +- 1 = 6, 4, 4, 2 and their negatives: six of eight as far as |4|
    assert c.p_value == pytest.approx(6 / 8)
    # the copies as independent prompts: b' = 2.5, c' = 6.5, n' = 14, d = 4 / 14 = 0.285714,
    # var = (9 - 4**2 / 14) / 14**2 = 0.040087, half = 0.392421; McNemar(2, 6) = 2 * (1 + 8 + 28) / 2**8
    copies = paired_change(before, after)
    assert copies.low == pytest.approx(0.285714 - 0.392421, abs=1e-5)
    assert copies.p_value == pytest.approx(74 / 256)
    assert c.high - c.low > copies.high - copies.low


def test_mismatched_or_empty_verdicts_are_refused():
    with pytest.raises(ValueError, match="same prompts"):
        paired_change([True], [True, False])
    with pytest.raises(ValueError, match="at least one prompt"):
        paired_change([], [])
    with pytest.raises(ValueError, match="2 requests for 3 prompts"):
        paired_change([True] * 3, [False] * 3, ["a", "b"])


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
