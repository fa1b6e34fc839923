"""Accuracy without math-verify: verdicts decided exactly where that is provably math-verify's verdict.

Plain numbers are compared as exact fractions; answers in a small LaTeX subset go through the engine in
`math_latex`. Anything else is left to `math_verify_pool` (None). Pure Python.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, NamedTuple

from grpo.rewards.answers import strip_answer_wrapping
from grpo.rewards.math_latex import latex_exact, latex_value

# An int or decimal with an optional sign and well-formed thousands commas
# ("7,425,000"); "1,5" (ambiguous: tuple or decimal comma) is left to math-verify.
_PLAIN_NUMBER_RE = re.compile(
    r"(?P<sign>[+-]?)(?:(?P<int>[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d*))?|\.(?P<frac_only>\d+))"
)
# a/b, \frac{a}{b}, \dfrac{a}{b}, \tfrac{a}{b}, \frac ab (single digits).
_PLAIN_RATIONAL_RE = re.compile(
    r"(?P<sign>[+-]?)(?:"
    r"\\[dt]?frac\{(?P<n1>[+-]?\d+)\}\{(?P<d1>\d+)\}"
    r"|\\[dt]?frac(?P<n2>\d)(?P<d2>\d)"
    r"|(?P<n3>\d+)/(?P<d3>\d+))"
)
# Above this many significant digits a decimal is no longer exact in sympy's
# 15-digit Float, so the verdict is left to math-verify.
_MAX_DECIMAL_DIGITS = 15


class _Plain(NamedTuple):
    value: Fraction
    decimal: bool  # has a decimal point: math-verify may treat it as a Float
    digits: int  # significant digits written


def parse_plain(text: str) -> _Plain | None:
    """A plain number (int, decimal, simple fraction) as an exact Fraction, else None."""
    s = strip_answer_wrapping(text)
    m = _PLAIN_NUMBER_RE.fullmatch(s)
    if m:
        int_part = (m["int"] or "").replace(",", "")
        frac = m["frac"] if m["frac"] is not None else m["frac_only"]
        value = Fraction(int(int_part or "0"))
        if frac:
            value += Fraction(int(frac), 10 ** len(frac))
        digits = len((int_part + (frac or "")).lstrip("0"))
        sign = -1 if m["sign"] == "-" else 1
        return _Plain(sign * value, frac is not None, digits)
    m = _PLAIN_RATIONAL_RE.fullmatch(s)
    if m:
        num = m["n1"] or m["n2"] or m["n3"]
        den = int(m["d1"] or m["d2"] or m["d3"])
        if den == 0 or (m["sign"] and num[0] in "+-"):  # 1/0, "-\frac{-1}{2}": math-verify decides
            return None
        sign = -1 if m["sign"] == "-" else 1
        return _Plain(sign * Fraction(int(num), den), False, 0)
    return None


def _plain_verdict(g: _Plain, p: _Plain) -> bool | None:
    """Two plain numbers, as math-verify would judge them; None = let it decide.

    math-verify compares Integer/Rational exactly, and rounds to 6 decimals as
    soon as one side is a Float. Equal exact values are equal either way;
    different values are different when the rounding cannot make them equal
    (exact types, or clearly apart), else its rounding rule is applied.
    """
    if g.decimal or p.decimal:
        if max(g.digits, p.digits) > _MAX_DECIMAL_DIGITS:
            return None
    if g.value == p.value:
        return True
    if not (g.decimal or p.decimal):
        return False
    gap = abs(g.value - p.value)
    scale = max(abs(g.value), abs(p.value))
    if gap > Fraction(2, 10**6) + scale / 10**12:
        return False
    return _rounded_equal(g, p)


def _rounded_equal(g: _Plain, p: _Plain) -> bool:
    """math-verify's rule for two close numbers of which one is a Float, on the
    sympy numbers its parser builds: equal after rounding both to 6 decimals.

    Its parser reads a decimal into a 53-bit Float (correctly rounded, as
    Float(Rational, 15) is) and a fraction into a Rational; sympy's own round()
    then gives exactly its verdict, at a fraction of the cost of parsing LaTeX.
    """
    import sympy

    def as_sympy(x: _Plain) -> Any:
        value = sympy.Rational(x.value.numerator, x.value.denominator)
        return sympy.Float(value, 15) if x.decimal else value

    return bool(as_sympy(g).round(6) == as_sympy(p).round(6))



def fast_verdict(gold: str, pred: str) -> bool | None:
    """Decide without math-verify when that is provably its verdict; None = ask it.

    1. Both plain numbers: exact comparison (see _plain_verdict).
    2. Both in the LaTeX subset: the same string parses the same way, so it is
       equal (the subset always parses); values clearly apart are different.
    3. Both in its exact part (no decimals) with the same canonical value:
       equal. math-verify reads such an answer as an expression with no Float,
       set, relation or lone symbol, so its verdict comes down to
       ``simplify(gold - pred) == 0``, and sympy itself expands products,
       merges like terms and reduces square roots of integers (sqrt(12) is
       2*sqrt(3)), which is what the canonical form does.
    """
    g, p = parse_plain(gold), parse_plain(pred)
    if g is not None and p is not None:
        return _plain_verdict(g, p)
    gv = latex_value(gold)
    if gv is None:
        return None
    if strip_answer_wrapping(pred) == strip_answer_wrapping(gold):
        return True
    pv = latex_value(pred)
    if pv is None:
        return None
    if abs(gv - pv) > 1e-5 * max(1.0, abs(gv), abs(pv)):  # far beyond float error and rounding
        return False
    exact = latex_exact(gold)
    if exact is not None and not exact.is_lone_variable() and exact == latex_exact(pred):
        return True
    return None
