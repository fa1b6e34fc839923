"""Before -> after on the same prompts: the paired difference of two shares and its 95% interval.

A stage's effect is read on the same prompts before and after it, one verdict (right / not right) each. The pairs
whose verdict did not change say nothing about the change; the discordant ones do: `b` prompts went from right to
wrong, `c` from wrong to right, and the change of the share is (c - b) / n.
- The interval is Agresti and Min's (2005) adjusted Wald interval for matched proportions: half a prompt added to
  each of the four cells of the before/after table, then the Wald interval of the difference. It keeps close to its
  95% where the plain Wald interval collapses (no discordant pair gives it zero width).
- The p-value is McNemar's exact test: under "no change", each discordant pair is a fair coin, so
  p = 2 * P(Binomial(b + c, 1/2) <= min(b, c)), at most 1.
A change whose interval crosses zero is reported as "within noise".

Pure Python: must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


class PairedChange(NamedTuple):
    n: int  # prompts measured both times
    before: float  # share right before
    after: float  # share right after
    worse: int  # right before, wrong after (b)
    better: int  # wrong before, right after (c)
    low: float  # 95% interval of after - before
    high: float
    p_value: float  # McNemar's exact test

    @property
    def change(self) -> float:
        return self.after - self.before

    @property
    def within_noise(self) -> bool:
        return self.low <= 0.0 <= self.high

    def describe(self, digits: int = 3) -> str:
        """One line: `0.550 -> 0.700 (+0.150, 95% CI +0.050..+0.250, p 0.004, n 200)`, plus ", within noise"
        where the interval crosses zero."""
        f = f"{{:.{digits}f}}"
        s = f"{{:+.{digits}f}}"
        line = (f"{f.format(self.before)} -> {f.format(self.after)} ({s.format(self.change)}, 95% CI "
                f"{s.format(self.low)}..{s.format(self.high)}, p {self.p_value:.3g}, n {self.n})")
        return line + (", within noise" if self.within_noise else "")


def mcnemar_exact(worse: int, better: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts.

    >>> round(mcnemar_exact(1, 9), 4)  # 2 * (1 + 10) / 2**10
    0.0215
    """
    m = worse + better
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(worse, better) + 1)) / 2 ** m
    return min(1.0, 2 * tail)


def paired_change(before: Sequence[bool], after: Sequence[bool]) -> PairedChange:
    """The change of the share right from `before` to `after` (one verdict per prompt, same prompts, same order).

    >>> c = paired_change([True] * 6 + [False] * 4, [True] * 5 + [False] + [True] * 3 + [False])
    >>> c.before, c.after, c.worse, c.better
    (0.6, 0.8, 1, 3)
    """
    if len(before) != len(after):
        raise ValueError(f"paired verdicts need the same prompts: {len(before)} before, {len(after)} after")
    n = len(before)
    if n == 0:
        raise ValueError("no prompt to compare: a paired change needs at least one prompt measured twice")
    both = sum(1 for a, b in zip(before, after) if a and b)
    worse = sum(1 for a, b in zip(before, after) if a and not b)
    better = sum(1 for a, b in zip(before, after) if b and not a)
    # Agresti-Min: half a prompt in each cell
    b_, c_, n_ = worse + 0.5, better + 0.5, n + 2.0
    d = (c_ - b_) / n_
    var = max(((b_ + c_) - (c_ - b_) ** 2 / n_) / n_ ** 2, 0.0)
    half = Z95 * math.sqrt(var)
    return PairedChange(n, (both + worse) / n, (both + better) / n, worse, better, max(-1.0, d - half),
                        min(1.0, d + half), mcnemar_exact(worse, better))


def logged_changes(metrics: dict[str, float]) -> dict[str, str]:
    """The paired changes a stage logged (`<figure>_before`, `<figure>`, `<figure>_ci_low`, `_ci_high`, `_p`, `_n`),
    each as `describe`'s line, keyed by figure: what a stage's summary prints in place of those six numbers.

    >>> logged_changes({"a/x_before": 0.5, "a/x": 0.7, "a/x_ci_low": 0.1, "a/x_ci_high": 0.3, "a/x_p": 0.01,
    ...                 "a/x_n": 100.0})
    {'a/x': '0.500 -> 0.700 (+0.200, 95% CI +0.100..+0.300, p 0.01, n 100)'}
    """
    out = {}
    for key in sorted(k[: -len("_ci_low")] for k in metrics if k.endswith("_ci_low")):
        parts = [f"{key}_before", key, f"{key}_ci_low", f"{key}_ci_high", f"{key}_p", f"{key}_n"]
        if all(p in metrics for p in parts):
            before, after, low, high, p, n = (metrics[p] for p in parts)
            out[key] = PairedChange(int(n), before, after, 0, 0, low, high, p).describe()
    return out


CHANGE_SUFFIXES = ("_before", "", "_ci_low", "_ci_high", "_p", "_n")  # the keys `logged_changes` reads per figure
