"""Answer forms the accuracy rule reads before it compares: a whole answer written in a way math-verify cannot parse,
rewritten to one it can, and answers that are words compared as words. Pure Python.

Each rewrite applies to the whole answer only (never to a number inside a sentence), so nothing that parsed before
reads differently: "1e3" and "2.5E-4" (plain scientific notation), "1 000" and "1\\,000" (spaced thousands), "3 1/2"
(a mixed number), "seven" and "twenty-one" (a number in words), "∞" and "×" (their LaTeX names).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from grpo.rewards.answers import strip_answer_wrapping

_SCIENTIFIC = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)[eE][+-]?\d{1,3}")
_SPACED_THOUSANDS = re.compile(r"(?P<sign>[+-]?)(?P<head>[1-9]\d{0,2})(?P<groups>(?:(?:\s|\\[,;: !]|~)\d{3})+)"
                               r"(?P<tail>\.\d+)?")
_MIXED = re.compile(r"(?P<sign>[+-]?)(?P<whole>\d+)\s+(?P<num>\d+)\s*/\s*(?P<den>\d+)")
_UNICODE = {"∞": "\\infty", "×": "\\times", "·": "\\cdot", "√": "\\sqrt", "≤": "\\le", "≥": "\\ge"}

_UNITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
          "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_WORDS = {w: i for i, w in enumerate(_UNITS)} | {w: 20 + 10 * i for i, w in enumerate(_TENS)}
_WORDS |= {f"{t}{sep}{u}": 20 + 10 * i + j for i, t in enumerate(_TENS) for j, u in enumerate(_UNITS[1:10], 1)
           for sep in ("-", " ")}
_WORDS |= {"a hundred": 100, "one hundred": 100, "hundred": 100, "a thousand": 1000, "one thousand": 1000,
           "thousand": 1000, "a dozen": 12, "dozen": 12}

# a one-word answer ("Monday", "yes", "\text{blue}"): compared as words, not as math (which reads it as a product
# of symbols); names math-verify reads as constants stay with it
_TEXT_WRAP = re.compile(r"^\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{(?P<inner>[^{}]*)\}$")
_ONE_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]{3,}")  # four letters or more: "abc" may be a product of symbols
_SHORT_WORDS = {"yes", "no", "odd"}
_MATH_NAMES = {"pi", "infty", "inf", "infinity", "sqrt", "frac", "cdot", "times", "sin", "cos", "tan", "log", "exp"}


def rewrite(text: str) -> str:
    """The answer in a form the checks read, where the whole answer is one of the forms above; else as it was."""
    s = strip_answer_wrapping(text)
    for char, name in _UNICODE.items():
        if char in s:
            s = s.replace(char, name)
    inner = _TEXT_WRAP.match(s)
    words = " ".join((inner["inner"] if inner else s).lower().rstrip(".").split())
    if words in _WORDS:
        return str(_WORDS[words])
    if _SCIENTIFIC.fullmatch(s):
        try:
            return format(Decimal(s), "f")
        except InvalidOperation:
            return s
    if m := _SPACED_THOUSANDS.fullmatch(s):
        return m["sign"] + m["head"] + re.sub(r"\D", "", m["groups"]) + (m["tail"] or "")
    if (m := _MIXED.fullmatch(s)) and 0 < int(m["num"]) < int(m["den"]):
        whole, num, den = int(m["whole"]), int(m["num"]), int(m["den"])
        return f"{m['sign']}{whole * den + num}/{den}"
    return s if s != strip_answer_wrapping(text) else text


def word(text: str) -> str | None:
    """A one-word answer, folded for comparison ("\\text{Monday}" and "monday." are "monday"), else None."""
    s = strip_answer_wrapping(text)
    inner = _TEXT_WRAP.match(s)
    s = (inner["inner"] if inner else s).strip().rstrip(".!").strip()
    if not (_ONE_WORD.fullmatch(s) or s.lower() in _SHORT_WORDS) or s.lower() in _MATH_NAMES:
        return None
    return s.lower()


def word_verdict(gold: str, pred: str) -> bool | None:
    """For a one-word reference, whether the answer is that word (any case, in \\text{} or not); None for others."""
    g = word(gold)
    if g is None:
        return None
    s = strip_answer_wrapping(pred)
    inner = _TEXT_WRAP.match(s)
    return (inner["inner"] if inner else s).strip().rstrip(".!").strip().lower() == g
