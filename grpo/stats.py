"""Before -> after on the same prompts: the paired difference of two shares and its 95% interval, over requests.

A stage's effect is read on the same prompts before and after it, one verdict (right / not right) each. The pairs
whose verdict did not change say nothing about the change; the discordant ones do: `b` prompts went from right to
wrong, `c` from wrong to right, and the change of the share is (c - b) / N over the N prompts.

Prompts are not always independent: the synthetic general prompts (`grpo.data.general`) ask each request (a
phrasing of a subject) under six lead-ins ("", "Hi! ", ...), and a model answers the copies of one request alike, so
counting each copy as one more observation makes an interval too narrow. Each verdict therefore comes with its
request (`requests`; by default every prompt is its own), and the interval and the p-value are taken over distinct
requests: copies that move together count once, copies that disagree count for what they are. The shares stay shares
of prompts (what the stage logs as the figures), so a change is read where it was measured; only its uncertainty and
its size `n` (distinct requests) are by request.
- The interval is Agresti and Min's (2005) adjusted Wald interval for matched proportions with the variance summed by
  request (the cluster-robust, "sandwich" variance of a ratio): with `net_j` request j's prompts gone better minus
  those gone worse and `m_j` its prompts, J requests and m = N / J prompts a request on average, half a request of m
  prompts is added to each of the four cells of the before/after table, d = (c - b) / (N + 2m), and
      var = (sum_j (net_j - d * m_j)**2 + m**2 * (1 + 2 * d**2)) / (N + 2m)**2
  (the last term: the four half-requests' own share, 1/2 * (m - dm)**2 + 1/2 * (-m - dm)**2 + 2 * 1/2 * (dm)**2). With
  one prompt per request it is Agresti-Min's interval exactly; when requests have as many copies each and the copies
  move together it is Agresti-Min's on one verdict per request; when they disagree, each request weighs by its net
  change. The half-requests keep it open where the plain Wald interval collapses (no discordant pair gives it zero
  width); over a few requests only, a variance summed by request runs somewhat small, as cluster-robust ones do.
- The p-value is the exact sign-flip test over requests (`sign_flip_p`): under "no change" each request's net change
  is as likely to have either sign. With one prompt per request it is McNemar's exact test,
  p = 2 * P(Binomial(b + c, 1/2) <= min(b, c)), at most 1.
A change whose interval crosses zero is reported as "within noise".

Why not one verdict per request (a majority, or all of its copies right)? A majority of an even number of copies can
tie, "all copies" would make a borderline request count as over-refused only when every copy is refused, and either
would move the centre of the change away from the shares the stage logs. The interval above keeps the shares and
needs no choice of rule; it is deterministic (no resampling) and pure Python. Requests are taken as independent of one
another: two phrasings of one subject are two requests.

Pure Python: must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import NamedTuple

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


class PairedChange(NamedTuple):
    n: int  # distinct requests measured both times (the prompts when each is its own request)
    before: float  # share of prompts right before
    after: float  # share of prompts right after
    worse: int  # prompts right before, wrong after (b)
    better: int  # prompts wrong before, right after (c)
    low: float  # 95% interval of after - before, over requests
    high: float
    p_value: float  # the exact sign-flip test over requests (McNemar's exact test, one prompt a request)

    @property
    def change(self) -> float:
        return self.after - self.before

    @property
    def within_noise(self) -> bool:
        return self.low <= 0.0 <= self.high

    def describe(self, digits: int = 3) -> str:
        """One line: `0.550 -> 0.700 (+0.150, 95% CI +0.050..+0.250, p 0.004, n 64 requests)`, plus ", within
        noise" where the interval crosses zero."""
        f = f"{{:.{digits}f}}"
        s = f"{{:+.{digits}f}}"
        line = (f"{f.format(self.before)} -> {f.format(self.after)} ({s.format(self.change)}, 95% CI "
                f"{s.format(self.low)}..{s.format(self.high)}, p {self.p_value:.3g}, n {self.n} requests)")
        return line + (", within noise" if self.within_noise else "")


def mcnemar_exact(worse: int, better: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (`sign_flip_p` with one prompt per request).

    >>> round(mcnemar_exact(1, 9), 4)  # 2 * (1 + 10) / 2**10
    0.0215
    """
    m = worse + better
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(worse, better) + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def sign_flip_p(net: Sequence[int]) -> float:
    """Two-sided exact p-value of the sign-flip test on requests' net changes (prompts gone better minus gone worse):
    under "no change" each nonzero net is as likely to be negative as positive, so p is the share of the 2**J' sign
    patterns of the J' nonzero nets whose sum is at least as far from zero as the one seen.

    >>> sign_flip_p([4, 4, 0])  # the two nonzero nets' patterns sum to +8, 0, 0, -8: two of four reach |8|
    0.5
    >>> sign_flip_p([1] * 9 + [-1]) == mcnemar_exact(1, 9)  # one prompt a request: McNemar's exact test
    True
    """
    seen = abs(sum(net))
    patterns = {0: 1}  # sum -> how many sign patterns reach it (exact integers)
    # the requests with the same |net| at once: k of them, i positive, sum (2i - k) * |net| in comb(k, i) patterns
    for size, k in Counter(abs(x) for x in net if x).items():
        ways = [(size * (2 * i - k), math.comb(k, i)) for i in range(k + 1)]
        step: dict[int, int] = {}
        for total, count in patterns.items():
            for shift, w in ways:
                step[total + shift] = step.get(total + shift, 0) + count * w
        patterns = step
    return sum(c for total, c in patterns.items() if abs(total) >= seen) / sum(patterns.values())


def paired_change(before: Sequence[bool], after: Sequence[bool],
                  requests: Sequence[Hashable] | None = None) -> PairedChange:
    """The change of the share right from `before` to `after` (one verdict per prompt, same prompts, same order),
    with its interval and p-value over the distinct `requests` (each prompt's request, e.g. its text without the
    lead-in; None: every prompt is its own request).

    >>> c = paired_change([True] * 6 + [False] * 4, [True] * 5 + [False] + [True] * 3 + [False])
    >>> c.before, c.after, c.worse, c.better, c.n
    (0.6, 0.8, 1, 3, 10)
    >>> paired_change([False, False, True, True], [True, True, True, True], ["a", "a", "b", "b"]).n
    2
    """
    if len(before) != len(after):
        raise ValueError(f"paired verdicts need the same prompts: {len(before)} before, {len(after)} after")
    n = len(before)
    if n == 0:
        raise ValueError("no prompt to compare: a paired change needs at least one prompt measured twice")
    if requests is not None and len(requests) != n:
        raise ValueError(f"each verdict needs its request: {len(requests)} requests for {n} prompts")
    net: dict[Hashable, int] = {}  # request -> its prompts gone better minus those gone worse
    size: dict[Hashable, int] = {}  # request -> its prompts
    for a, b, r in zip(before, after, range(n) if requests is None else requests):
        net[r] = net.get(r, 0) + (1 if b and not a else -1 if a and not b else 0)
        size[r] = size.get(r, 0) + 1
    both = sum(1 for a, b in zip(before, after) if a and b)
    worse = sum(1 for a, b in zip(before, after) if a and not b)
    better = sum(1 for a, b in zip(before, after) if b and not a)
    # Agresti-Min by request: half a request of m prompts in each cell, the variance summed by request
    m = n / len(size)
    n_ = n + 2 * m
    d = (better - worse) / n_
    var = (sum((net[r] - d * size[r]) ** 2 for r in size) + m ** 2 * (1 + 2 * d ** 2)) / n_ ** 2
    half = Z95 * math.sqrt(var)
    return PairedChange(len(size), (both + worse) / n, (both + better) / n, worse, better, max(-1.0, d - half),
                        min(1.0, d + half), sign_flip_p(list(net.values())))


def logged_changes(metrics: dict[str, float]) -> dict[str, str]:
    """The paired changes a stage logged (`<figure>_before`, `<figure>`, `<figure>_ci_low`, `_ci_high`, `_p`, `_n`),
    each as `describe`'s line, keyed by figure: what a stage's summary prints in place of those six numbers.

    >>> logged_changes({"a/x_before": 0.5, "a/x": 0.7, "a/x_ci_low": 0.1, "a/x_ci_high": 0.3, "a/x_p": 0.01,
    ...                 "a/x_n": 100.0})
    {'a/x': '0.500 -> 0.700 (+0.200, 95% CI +0.100..+0.300, p 0.01, n 100 requests)'}
    """
    out = {}
    for key in sorted(k[: -len("_ci_low")] for k in metrics if k.endswith("_ci_low")):
        parts = [f"{key}_before", key, f"{key}_ci_low", f"{key}_ci_high", f"{key}_p", f"{key}_n"]
        if all(p in metrics for p in parts):
            before, after, low, high, p, n = (metrics[p] for p in parts)
            out[key] = PairedChange(int(n), before, after, 0, 0, low, high, p).describe()
    return out


CHANGE_SUFFIXES = ("_before", "", "_ci_low", "_ci_high", "_p", "_n")  # the keys `logged_changes` reads per figure
