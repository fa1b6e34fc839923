"""Rule-based rewards for GRPO (the DeepSeek-R1 recipe), TRL/open-r1 contract.

A reward function is ``fn(completions, **dataset_columns) -> list[float | None]``:

* a completion is a string or a list of chat messages (the last assistant
  message's ``content`` is scored);
* dataset columns arrive as keyword lists aligned with ``completions``
  (``answer=[...]``); unknown keywords are accepted and ignored (TRL also passes
  ``prompts``, ``completion_ids``, ``trainer_state``);
* ``None`` means "not scorable" (TRL turns it into NaN).

Everything here is pure: no Prefect, no MLflow. The only module-level mutable
state is the lazily created process pool used for the symbolic math check
(see ``_SymbolicPool``).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import math
import multiprocessing
import numbers
import os
import re
import signal
import threading
import unicodedata
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from fractions import Fraction
from itertools import product
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

__all__ = [
    "AccuracyReport",
    "REWARD_FUNCTIONS",
    "RewardScores",
    "UnknownRewardError",
    "accuracy_reward",
    "check_accuracy",
    "completion_text",
    "extract_answer",
    "extract_boxed",
    "format_reward",
    "format_reward_strict",
    "language_consistency_reward",
    "make_format_reward",
    "make_overlong_penalty",
    "overlong_penalty",
    "prepare_for_math_verify",
    "score_completions",
    "shutdown_symbolic_pool",
    "tag_count_reward",
]

THINK_TAGS = ("<think>", "</think>")
ANSWER_TAGS = ("<answer>", "</answer>")


# --------------------------------------------------------------------------
# Completion text
# --------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    """Message content as text; multimodal part lists keep their text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return str(content)


def completion_text(completion: Any) -> str:
    """The text to score: a string as is, or the last assistant message's content."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):  # a single message
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)):
        messages = [m for m in completion if isinstance(m, Mapping)]
        for message in reversed(messages):
            if message.get("role") == "assistant":
                return _content_text(message.get("content"))
        # No role information: the last message is the model's turn.
        return _content_text(messages[-1].get("content")) if messages else ""
    return str(completion)


# --------------------------------------------------------------------------
# Format rewards
# --------------------------------------------------------------------------


def _has_format(
    text: str, *, strict: bool, think_tags: Sequence[str], answer_tags: Sequence[str]
) -> bool:
    t_open, t_close = map(re.escape, think_tags)
    a_open, a_close = map(re.escape, answer_tags)
    if strict:
        # Each tag exactly once, so ".*" below cannot swallow another block.
        if any(text.count(tag) != 1 for tag in (*think_tags, *answer_tags)):
            return False
        pattern = rf"\s*{t_open}.*{t_close}\s*{a_open}.*{a_close}\s*"
        return re.fullmatch(pattern, text, re.DOTALL) is not None
    pattern = rf"{t_open}.*?{t_close}.*?{a_open}.*?{a_close}"
    return re.search(pattern, text, re.DOTALL) is not None


def format_reward(
    completions: Sequence[Any],
    *,
    strict: bool = False,
    think_tags: Sequence[str] = THINK_TAGS,
    answer_tags: Sequence[str] = ANSWER_TAGS,
    prefilled_think: bool = False,
    **_: Any,
) -> list[float]:
    """1.0 for ``<think>…</think>…<answer>…</answer>``, else 0.0.

    lenient: the four tags in that order, any other text around them.
    strict: exactly that structure, each tag once, only whitespace between and
    around the blocks, nothing after ``</answer>``. Block contents are free
    (they may be empty) but may not contain the tags.
    prefilled_think: the chat template already opened the think block in the
    prompt, so the completion starts inside it (no opening tag expected; an
    opening tag in the completion counts as a second one).
    """
    scores = []
    for completion in completions:
        text = completion_text(completion)
        if prefilled_think:
            text = think_tags[0] + text
        ok = _has_format(text, strict=strict, think_tags=think_tags, answer_tags=answer_tags)
        scores.append(1.0 if ok else 0.0)
    return scores


def format_reward_strict(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """``format_reward`` with ``strict=True`` (a real function, so TRL can log its name)."""
    kwargs["strict"] = True
    return format_reward(completions, **kwargs)


def make_format_reward(name: str = "format_reward", **config: Any) -> Callable[..., list[float]]:
    """A ``format_reward`` with fixed settings (tags, strict, prefilled_think).

    Unlike functools.partial, the result has a ``__name__`` (TRL logs it).
    """
    unknown = set(config) - {"strict", "think_tags", "answer_tags", "prefilled_think"}
    if unknown:
        raise TypeError(f"make_format_reward got unknown settings: {sorted(unknown)}")

    def configured(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return format_reward(completions, **{**kwargs, **config})

    configured.__name__ = configured.__qualname__ = name
    return configured


def tag_count_reward(
    completions: Sequence[Any],
    *,
    think_tags: Sequence[str] = THINK_TAGS,
    answer_tags: Sequence[str] = ANSWER_TAGS,
    prefilled_think: bool = False,
    **_: Any,
) -> list[float]:
    """0.25 for each of the four tags that appears exactly once (open-r1).

    open-r1 counts the tags with their surrounding newlines; here the bare tags
    are counted, so the reward does not depend on whitespace style. With
    ``prefilled_think`` the opening think tag lives in the prompt: it earns its
    0.25 when the completion does not repeat it.
    """
    scores = []
    for completion in completions:
        text = completion_text(completion)
        score = 0.0
        for i, tag in enumerate((*think_tags, *answer_tags)):
            expected = 0 if (prefilled_think and i == 0) else 1
            if text.count(tag) == expected:
                score += 0.25
        scores.append(score)
    return scores


# --------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------

_BOXED_RE = re.compile(r"\\boxed\s*\{")


def _balanced_group(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``text[start] == "{"``, or None if unclosed.

    Escaped braces (``\\{``, ``\\}``) are literal characters, not grouping.
    """
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{…}`` (nested braces allowed), else None.

    A truncated last box (never closed) is skipped in favour of an earlier one.
    """
    for match in reversed(list(_BOXED_RE.finditer(text))):
        content = _balanced_group(text, match.end() - 1)
        if content is not None:
            return content.strip()
    return None


def extract_answer(text: str, answer_tags: Sequence[str] = ANSWER_TAGS) -> str | None:
    """Content of the last ``<answer>…</answer>``, else of the last ``\\boxed{…}``, else None."""
    text = completion_text(text)
    a_open, a_close = answer_tags
    close = text.rfind(a_close)
    if close != -1:
        open_ = text.rfind(a_open, 0, close)
        if open_ != -1:
            return text[open_ + len(a_open) : close].strip()
    return extract_boxed(text)


# --------------------------------------------------------------------------
# Accuracy: fast paths (decided without math-verify)
# --------------------------------------------------------------------------

_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
_LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
_PROSE_WORD_RE = re.compile(r"[A-Za-z]{4,}")

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


def _strip_answer_wrapping(text: str) -> str:
    """Drop surrounding whitespace, a trailing full stop and one pair of $…$ or $$…$$."""
    s = text.strip()
    for _ in range(2):
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1].rstrip()
        for delim in ("$$", "$"):
            if len(s) > 2 * len(delim) and s.startswith(delim) and s.endswith(delim):
                s = s[len(delim) : -len(delim)].strip()
                break
    return s


def _parse_plain(text: str) -> _Plain | None:
    """A plain number (int, decimal, simple fraction) as an exact Fraction, else None."""
    s = _strip_answer_wrapping(text)
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


# A small LaTeX arithmetic subset (numbers, single-letter variables, \pi, + - * /
# \cdot \times, implicit products, ^, \frac, \sqrt, parentheses), read by one
# parser and evaluated two ways:
# * in floats at a fixed positive point (_FloatArithmetic), to prove two answers
#   DIFFERENT (see _clearly_different for why that implies math-verify's False);
# * exactly, as a canonical sum of terms (_Exact), to prove them EQUAL (see
#   _fast_verdict for why that implies math-verify's True).
# tests/test_rewards.py checks both readings against math-verify's own parse and
# verdicts on a sample of the grammar.
_LATEX_TOKEN_RE = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|\\([A-Za-z]+)|([A-Za-z])|([-+*/^(){}\[\]]))")
# Not e, i (constants), f (function), nor any letter math-verify strips as a
# unit after a number ("2m", "3 t": c d g h l m o s t).
_VARIABLES = frozenset("abknpqruvwxyz")
_MAX_LATEX_CHARS = 200


class _NotInSubset(Exception):
    pass


def _probe(name: str) -> float:
    return 1.0 + math.sqrt(ord(name)) / 10  # distinct, positive, irrational-ish per letter


class _FloatArithmetic:
    """Values at the probe point: a cheap way to tell two answers apart."""

    @staticmethod
    def number(text: str) -> float:
        return float(text)

    @staticmethod
    def variable(name: str) -> float:
        return _probe(name)

    @staticmethod
    def pi() -> float:
        return math.pi

    @staticmethod
    def divide(a: float, b: float) -> float:
        if b == 0:
            raise _NotInSubset
        return a / b

    @staticmethod
    def power(base: float, exponent: float) -> float:
        if (base < 0 and exponent != int(exponent)) or (base == 0 and exponent <= 0):
            raise _NotInSubset
        return base**exponent  # OverflowError is caught by the caller

    @staticmethod
    def root(radicand: float, n: int) -> float:
        if radicand < 0:
            raise _NotInSubset
        return radicand ** (1 / n)


# An exact term is coefficient * pi^k * sqrt(m) * x^a * y^b ...; its key is
# (k, m, (("x", a), ("y", b), ...)) with m square-free (1: no root) and the
# variables sorted, so equal values have equal term dicts. Bounded so that a
# long answer cannot make the exact check itself slow.
_TermKey = tuple[int, int, tuple[tuple[str, int], ...]]
_ONE: _TermKey = (0, 1, ())
_MAX_EXACT_TERMS = 32
_MAX_EXACT_EXPONENT = 8
_MAX_EXACT_BITS = 4096  # per coefficient: nested powers grow them geometrically
_MAX_RADICAND = 10**9


def _split_square(m: int) -> tuple[int, int]:
    """m = k^2 * s with s square-free, as (k, s); m <= _MAX_RADICAND."""
    k, s, d = 1, 1, 2
    while d * d * d <= m:
        while m % (d * d) == 0:
            m //= d * d
            k *= d
        if m % d == 0:
            m //= d
            s *= d
        d += 1
    # What is left has no factor below d and is < d^3: 1, p, p^2 or p*q.
    r = math.isqrt(m)
    if r > 1 and r * r == m:
        return k * r, s
    return k, s * m


class _Exact:
    """An exact value in Q[pi, pi^-1, sqrt(2), sqrt(3), ..., x, y, ...], kept canonical."""

    __slots__ = ("terms",)

    def __init__(self, terms: dict[_TermKey, Fraction]) -> None:
        if len(terms) > _MAX_EXACT_TERMS:
            raise _NotInSubset
        self.terms = terms  # no zero coefficients

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Exact) and self.terms == other.terms

    __hash__ = None  # type: ignore[assignment]

    def rational(self) -> Fraction | None:
        """The value if it is a rational number, else None."""
        if not self.terms:
            return Fraction(0)
        return self.terms[_ONE] if len(self.terms) == 1 and _ONE in self.terms else None

    def is_lone_variable(self) -> bool:
        if len(self.terms) != 1:
            return False
        ((pi, root, variables), coeff), = self.terms.items()
        return coeff == 1 and pi == 0 and root == 1 and len(variables) == 1 and variables[0][1] == 1

    def __add__(self, other: _Exact) -> _Exact:
        terms = dict(self.terms)
        for key, coeff in other.terms.items():
            total = terms.get(key, 0) + coeff
            if total:
                terms[key] = total
            else:
                terms.pop(key, None)
        return _Exact(terms)

    def __neg__(self) -> _Exact:
        return _Exact({key: -coeff for key, coeff in self.terms.items()})

    def __sub__(self, other: _Exact) -> _Exact:
        return self + -other

    def __mul__(self, other: _Exact) -> _Exact:
        terms: dict[_TermKey, Fraction] = {}
        for (pi1, root1, vars1), c1 in self.terms.items():
            for (pi2, root2, vars2), c2 in other.terms.items():
                g = math.gcd(root1, root2)  # sqrt(a) sqrt(b) = g sqrt(ab / g^2), still square-free
                root = (root1 // g) * (root2 // g)
                if root > _MAX_RADICAND:
                    raise _NotInSubset
                powers = dict(vars1)
                for name, exponent in vars2:
                    powers[name] = powers.get(name, 0) + exponent
                key = (pi1 + pi2, root, tuple(sorted(powers.items())))
                terms[key] = terms.get(key, 0) + c1 * c2 * g
        return _Exact({key: coeff for key, coeff in terms.items() if coeff})


class _ExactArithmetic:
    """Exact values; anything outside _Exact (decimals, other roots, division by a
    sum or a variable, negative or large powers) is left to math-verify."""

    @staticmethod
    def number(text: str) -> _Exact:
        if not text.isdigit():  # a decimal is a Float to math-verify: its rounding rules apply
            raise _NotInSubset
        return _Exact({_ONE: Fraction(int(text))} if int(text) else {})

    @staticmethod
    def variable(name: str) -> _Exact:
        return _Exact({(0, 1, ((name, 1),)): Fraction(1)})

    @staticmethod
    def pi() -> _Exact:
        return _Exact({(1, 1, ()): Fraction(1)})

    @staticmethod
    def divide(a: _Exact, b: _Exact) -> _Exact:
        if len(b.terms) != 1:
            raise _NotInSubset
        ((pi, root, variables), coeff), = b.terms.items()
        if variables:
            raise _NotInSubset
        # 1 / (c pi^k sqrt(m)) = sqrt(m) / (c m) * pi^-k
        return a * _Exact({(-pi, root, ()): 1 / (coeff * root)})

    @staticmethod
    def power(base: _Exact, exponent: _Exact) -> _Exact:
        e = exponent.rational()
        if e is None or e.denominator != 1 or not 1 <= e <= _MAX_EXACT_EXPONENT:
            raise _NotInSubset
        bits = max((max(c.numerator.bit_length(), c.denominator.bit_length()) for c in base.terms.values()), default=0)
        if bits * e > _MAX_EXACT_BITS:  # ((((1/9)^8)^8)^8)^8 is 0.0 in floats, not a cheap exact value
            raise _NotInSubset
        result = base
        for _ in range(int(e) - 1):
            result = result * base
        return result

    @staticmethod
    def root(radicand: _Exact, n: int) -> _Exact:
        q = radicand.rational()
        if n != 2 or q is None or q < 0:
            raise _NotInSubset
        m = q.numerator * q.denominator  # sqrt(a/b) = sqrt(ab) / b
        if m > _MAX_RADICAND:
            raise _NotInSubset
        if m == 0:
            return _Exact({})
        k, s = _split_square(m)
        return _Exact({(0, s, ()): Fraction(k, q.denominator)})


def _tokenize_latex(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _LATEX_TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip():
                raise _NotInSubset
            break
        kind = "num" if m[1] else "cmd" if m[2] else "var" if m[3] else "op"
        value = m[1] or m[2] or m[3] or m[4]
        if kind == "cmd" and value in ("left", "right"):  # \left( … \right)
            pos = m.end()
            continue
        if kind == "var" and (value not in _VARIABLES or (tokens and tokens[-1][0] == "var")):
            raise _NotInSubset  # adjacent letters can read as a unit ("ab", "yr") or a word
        tokens.append((kind, value))
        pos = m.end()
    return tokens


class _LatexReader:
    """Recursive-descent reader over the token list, computing in ``arithmetic``; raises _NotInSubset."""

    def __init__(self, tokens: list[tuple[str, str]], arithmetic: Any) -> None:
        self.tokens = list(tokens)  # \sqrt23 splits a token in place
        self.ar = arithmetic
        self.i = 0
        self.root_tail = -1  # index of the "3" in \sqrt23, a factor of its own

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, kind: str | None = None, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (kind and tok[0] != kind) or (value and tok[1] != value):
            raise _NotInSubset
        self.i += 1
        return tok

    def value(self) -> Any:
        v = self.expr()
        if self.peek() is not None:
            raise _NotInSubset
        return v

    def expr(self) -> Any:
        v = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            op = self.take()[1]
            v = v + self.term() if op == "+" else v - self.term()
        return v

    def _starts_atom(self, tok: tuple[str, str] | None) -> bool:
        return tok is not None and (
            tok[0] == "var"
            or tok in (("op", "("), ("cmd", "pi"))
            or (tok[0] == "cmd" and tok[1] in ("frac", "dfrac", "tfrac", "sqrt"))
            or self.i == self.root_tail
        )

    def term(self) -> Any:
        v = self.unary()
        divided = False
        while True:
            tok = self.peek()
            if tok in (("op", "*"), ("cmd", "cdot"), ("cmd", "times")):
                self.take()
                v = v * self.unary()
            elif tok == ("op", "/"):
                self.take()
                v = self.ar.divide(v, self.unary())
                divided = True
            elif self._starts_atom(tok):  # implicit product: 2x, 3\sqrt{2}, x(x+1)
                # Not "1/2x" (which side gets x?) nor "2\frac{1}{2}" (a mixed number).
                if divided or tok[1] in ("frac", "dfrac", "tfrac"):
                    raise _NotInSubset
                v = v * self.power()
            else:
                return v

    def unary(self) -> Any:
        if self.peek() in (("op", "-"), ("op", "+")):
            return -self.unary() if self.take()[1] == "-" else self.unary()
        return self.power()

    def power(self) -> Any:
        base = self.atom()
        if self.peek() != ("op", "^"):
            return base
        self.take()
        exponent = self.group()
        if self.peek() == ("op", "^"):  # x^2^3: ambiguous
            raise _NotInSubset
        return self.ar.power(base, exponent)

    def group(self) -> Any:
        """{expr} or a single digit/letter, as LaTeX reads \\frac12 or x^2."""
        kind, value = self.take()
        if (kind, value) == ("op", "{"):
            v = self.expr()
            self.take("op", "}")
            return v
        if kind == "num" and len(value) == 1:
            return self.ar.number(value)
        if kind == "var":
            return self.ar.variable(value)
        raise _NotInSubset

    def atom(self) -> Any:
        kind, value = self.take()
        if kind == "num":
            if self.peek() is not None and self.peek()[0] == "num":
                raise _NotInSubset
            return self.ar.number(value)
        if kind == "var":
            if self.peek() is not None and self.peek()[0] == "num":  # x2
                raise _NotInSubset
            return self.ar.variable(value)
        if (kind, value) == ("cmd", "pi"):
            return self.ar.pi()
        if (kind, value) == ("op", "("):  # not a bare {…}: math-verify reads it as a set
            v = self.expr()
            self.take("op", ")")
            return v
        if kind == "cmd" and value in ("frac", "dfrac", "tfrac"):
            tok = self.peek()
            if tok is not None and tok[0] == "num" and len(tok[1]) == 2:  # \frac12
                self.take()
                num, den = self.ar.number(tok[1][0]), self.ar.number(tok[1][1])
            else:
                num, den = self.group(), self.group()
            return self.ar.divide(num, den)
        if (kind, value) == ("cmd", "sqrt"):
            n = 2
            tok = self.peek()
            if tok == ("op", "["):
                self.take()
                index = self.take("num")[1]
                self.take("op", "]")
                if not index.isdigit() or int(index) < 2:
                    raise _NotInSubset
                n = int(index)
            elif tok is not None and tok[0] == "num" and tok[1].isdigit() and len(tok[1]) > 1:
                # \sqrt23 is \sqrt{2} times 3, in LaTeX and in math-verify.
                self.tokens[self.i : self.i + 1] = [("num", tok[1][0]), ("num", tok[1][1:])]
                self.root_tail = self.i + 1
            return self.ar.root(self.group(), n)
        raise _NotInSubset


def _read_latex(text: str, arithmetic: Any) -> Any | None:
    """The value of a LaTeX answer in the subset, computed in ``arithmetic``; else None.

    A lone variable is excluded: math-verify compares symbols by name.
    """
    s = _strip_answer_wrapping(text)
    if not s or len(s) > _MAX_LATEX_CHARS or re.search(r"[A-Za-z]{3,}", _LATEX_COMMAND_RE.sub(" ", s)):
        return None  # 3+ letters in a row may read as prose to prepare_for_math_verify
    try:
        tokens = _tokenize_latex(s)
        if len(tokens) == 1 and tokens[0][0] == "var":
            return None
        return _LatexReader(tokens, arithmetic).value()
    except (_NotInSubset, ArithmeticError, ValueError, RecursionError):
        return None


def _latex_value(text: str) -> float | None:
    """The value of a LaTeX answer in the subset at the probe point, else None."""
    v = _read_latex(text, _FloatArithmetic)
    return v if isinstance(v, float) and math.isfinite(v) else None


def _latex_exact(text: str) -> _Exact | None:
    """The exact value of a LaTeX answer in the exact part of the subset, else None."""
    return _read_latex(text, _ExactArithmetic)


def _fast_verdict(gold: str, pred: str) -> bool | None:
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
    g, p = _parse_plain(gold), _parse_plain(pred)
    if g is not None and p is not None:
        return _plain_verdict(g, p)
    gv = _latex_value(gold)
    if gv is None:
        return None
    if _strip_answer_wrapping(pred) == _strip_answer_wrapping(gold):
        return True
    pv = _latex_value(pred)
    if pv is None:
        return None
    if abs(gv - pv) > 1e-5 * max(1.0, abs(gv), abs(pv)):  # far beyond float error and rounding
        return False
    exact = _latex_exact(gold)
    if exact is not None and not exact.is_lone_variable() and exact == _latex_exact(pred):
        return True
    return None


# --------------------------------------------------------------------------
# Accuracy: symbolic path (math-verify), run under our own timeout
# --------------------------------------------------------------------------



def prepare_for_math_verify(text: str) -> str:
    """The string handed to ``math_verify.parse`` for an extracted answer or a reference.

    math-verify only reads LaTeX inside math delimiters: a bare ``\\frac13`` or
    ``\\sqrt{2}`` parses to nothing. So bare math is wrapped in ``$…$``; text
    that already has delimiters, or reads as prose (a word of 4+ letters outside
    LaTeX commands, e.g. "The answer is 5"), is passed as is so math-verify's
    own answer anchors apply.
    """
    s = text.strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1].rstrip()
    if not s or any(d in s for d in _LATEX_DELIMITERS):
        return s
    if _PROSE_WORD_RE.search(_LATEX_COMMAND_RE.sub(" ", s)):
        return s
    return f"${s}$"


class _DropTimeoutDisabledNotice(logging.Filter):
    """math-verify warns once that its timeout is off; ours applies instead (see _SymbolicPool)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledNotice())

# Verdict codes exchanged with the worker processes (small ints pickle cheaply).
_EQUAL, _DIFFERENT, _TIMEOUT, _BAD_REFERENCE = 1, 0, -1, -2


class _SymbolicTimeout(BaseException):
    """Raised by our alarm. A BaseException so math-verify's ``except Exception`` cannot swallow it."""


@contextmanager
def _time_limit(seconds: float):
    """SIGALRM-based limit; only used in the pool's worker processes, where
    tasks run on the main thread (signals cannot be used elsewhere)."""

    def _raise(signum, frame):
        raise _SymbolicTimeout

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@functools.lru_cache(maxsize=4096)
def _mv_parse(text: str) -> tuple:
    """math-verify's parse, cached: the G completions of a GRPO group share one
    reference, and a parse (sympy expressions, immutable) is deterministic."""
    import math_verify

    # parsing_timeout=None: math-verify's signal.alarm fails off the main thread;
    # the caller imposes the time limit instead.
    return tuple(math_verify.parse(prepare_for_math_verify(text), parsing_timeout=None))


def _probe_values(symbols: Iterable[Any]) -> dict:
    """Deterministic positive rational values per symbol *name* (same name, same value)."""
    import sympy

    names = sorted({s.name for s in symbols})
    by_name = {n: sympy.Rational(13 + 7 * i, 11 + 2 * i) for i, n in enumerate(names)}
    return {s: by_name[s.name] for s in symbols}


def _is_elementary(expr: Any) -> bool:
    """A plain sympy Expr built from numbers, symbols, + * ^, pi, e, exp/log/trig."""
    import sympy
    from sympy.matrices.expressions import MatrixExpr

    allowed = (
        sympy.Add, sympy.Mul, sympy.Pow, sympy.Rational, sympy.Float, sympy.Symbol,
        sympy.core.numbers.NumberSymbol, sympy.exp, sympy.log, sympy.sin, sympy.cos, sympy.tan,
    )  # fmt: skip
    if not isinstance(expr, sympy.Expr) or isinstance(expr, (sympy.Symbol, MatrixExpr)):
        return False  # top-level Symbols get math-verify's name-based comparison
    return all(isinstance(node, allowed) for node in sympy.preorder_traversal(expr))


def _clearly_different(gold: Any, pred: Any) -> bool:
    """True only if gold and pred provably differ numerically, so verify() must say False.

    This skips math-verify's slow ``simplify(gold - pred)`` for wrong answers.
    Soundness: for elementary expressions, verify() is True only when they are
    equal as strings, equal after 6-decimal rounding, or ``simplify(a-b) == 0``;
    all three imply (near-)equal values at any point of the common domain. A
    real gap far beyond the rounding tolerance at one probe point rules them
    out. Anything else (sets, relations, percentages, symbols compared by name,
    complex or undefined values) returns False and goes to verify().
    """
    import sympy

    try:
        if not (_is_elementary(gold) and _is_elementary(pred)):
            return False
        subs = _probe_values(gold.free_symbols | pred.free_symbols)
        a = gold.evalf(30, subs=subs)
        b = pred.evalf(30, subs=subs)
        if not all(isinstance(v, (sympy.Float, sympy.Rational)) and v.is_finite for v in (a, b)):
            return False
        gap = abs(a - b)
        return bool(gap > 2e-6 + 1e-12 * max(abs(a), abs(b)))
    except Exception:
        return False


def _parsed_match(gold_parsed: list, pred_parsed: list) -> bool:
    """``math_verify.verify(gold, pred)`` with the provably-False pairs skipped.

    verify() on lists is ``any(compare(g, t) for g, t in product(gold, pred))``;
    calling it pair by pair keeps exactly those semantics.
    """
    import math_verify

    for g, t in product(gold_parsed, pred_parsed):
        if _clearly_different(g, t):
            continue
        if math_verify.verify(g, t, timeout_seconds=None):  # timeout: see _mv_parse
            return True
    return False


def _check_group(gold: str, preds: Sequence[str | None], timeout_s: float, use_alarm: bool) -> list[int]:
    """Verdict codes for one reference against several predictions (gold parsed once).

    ``None`` in ``preds`` asks only whether the reference parses.
    """
    limit = (lambda: _time_limit(timeout_s)) if use_alarm else nullcontext
    try:
        with limit():
            gold_parsed = _mv_parse(gold)
    except _SymbolicTimeout:
        return [_TIMEOUT] * len(preds)
    if not gold_parsed:
        return [_BAD_REFERENCE] * len(preds)
    codes = []
    for pred in preds:
        if pred is None:
            codes.append(_DIFFERENT)
            continue
        try:
            with limit():
                # Same string, same parse: reuse the reference's (parse is deterministic).
                pred_parsed = gold_parsed if pred == gold else _mv_parse(pred)
                equal = _parsed_match(gold_parsed, pred_parsed)
            code = _EQUAL if equal else _DIFFERENT  # outside the with: the alarm may fire in its exit
        except _SymbolicTimeout:
            code = _TIMEOUT
        codes.append(code)
    return codes


# A unit of work for one worker: (reference, [predictions]) groups.
_Chunk = list[tuple[str, list[str | None]]]


def _check_chunk(groups: _Chunk, timeout_s: float) -> list[list[int]]:
    """Worker-process entry point: each parse/verify under a SIGALRM limit."""
    return [_check_group(gold, preds, timeout_s, use_alarm=True) for gold, preds in groups]


def _init_worker() -> None:
    """Pool initializer: pay math-verify's import and first-parse costs once per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    # Warm math-verify's parser (its ANTLR DFA cache fills with use) on common answer shapes.
    for gold, pred in _WARMUP_PAIRS:
        _parsed_match(_mv_parse(gold), _mv_parse(pred))


_WARMUP_PAIRS = (
    ("\\frac{1}{2}", "0.5"),
    ("2\\sqrt{3}", "\\sqrt{12}"),
    ("x^2+3x", "x(x+3)"),
    ("\\frac{\\pi}{3}", "60^\\circ"),
    ("(1,2)", "\\{1,2\\}"),
    ("x=5", "5"),
)


def _worker_ready() -> bool:
    return True


_MATH_VERIFY_READY = threading.Event()


def _import_math_verify() -> None:
    if not _MATH_VERIFY_READY.is_set():
        import math_verify  # noqa: F401

        _MATH_VERIFY_READY.set()


def _check_in_thread(gold: str, pred: str | None, timeout_s: float) -> int:
    """The default symbolic check: a daemon thread per pair, waited on for at most 2 x timeout_s.

    Threads, not the process pool, by default: they need no `if __name__ == "__main__"` guard in the calling
    script and no worker start-up (seconds, or a minute on a busy machine, inside a training step). A thread
    cannot be killed, so a pathological pair keeps burning CPU in the background after its timeout; the caller
    still gets its verdict (0.0) on time. The process backend kills stuck checks and spreads them over cores.
    """
    _import_math_verify()  # a first import takes seconds: keep it outside the timed check
    result: list[int] = []

    def run() -> None:
        try:
            result.extend(_check_group(gold, [pred], timeout_s, use_alarm=False))
        except Exception:  # never let a worker error escape; scored as a timeout
            logger.exception("symbolic check failed")

    thread = threading.Thread(target=run, name="accuracy-reward-symbolic", daemon=True)
    thread.start()
    thread.join(2 * timeout_s)  # reference parse + prediction check
    return result[0] if result else _TIMEOUT


class _SymbolicPool:
    """Lazily created, reused process pool for the math-verify check.

    Why processes, not threads: math-verify's own timeout is signal.alarm,
    which only works on the main thread, and Prefect runs tasks in worker
    threads. A hung thread can never be killed, a process can. Each worker
    runs tasks on its own main thread, so there a SIGALRM limit interrupts a
    slow parse/simplify per pair (and lets the worker move on). If a worker is
    stuck where signals cannot reach (inside C code), the caller's backstop
    wait expires and the whole pool is killed and replaced.

    "spawn" rather than "fork": forking a process that already runs threads
    (Prefect, torch) can deadlock the child.
    """

    _STARTUP_GRACE_S = 60.0  # spawning workers imports sympy: slow on a busy box
    _BACKSTOP_SLACK_S = 10.0
    _MAX_BREAKS = 3  # after this many broken pools, use threads

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: cf.ProcessPoolExecutor | None = None
        self._breaks = 0
        self._warm = False  # some task has completed on the current executor

    @staticmethod
    def workers() -> int:
        return max(1, int(os.environ.get("R1_REWARD_WORKERS", min(4, os.cpu_count() or 1))))

    def _get(self) -> tuple[cf.ProcessPoolExecutor | None, bool]:
        """(executor or None when processes are unavailable, whether it may still be starting)."""
        with self._lock:
            if self._breaks >= self._MAX_BREAKS:
                return None, False
            if self._executor is not None:
                return self._executor, not self._warm
            self._warm = False
            try:
                self._executor = cf.ProcessPoolExecutor(
                    max_workers=self.workers(),
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                )
                # Workers are spawned on demand; start them all now, in parallel,
                # rather than one by one inside later (timed) checks.
                for _ in range(self.workers()):
                    self._executor.submit(_worker_ready)
            except Exception:
                logger.warning("cannot create a process pool; symbolic checks use threads", exc_info=True)
                self._breaks = self._MAX_BREAKS
                if self._executor is not None:
                    self._executor.shutdown(wait=False, cancel_futures=True)
                    self._executor = None
                return None, False
            return self._executor, True

    def _discard(self, executor: cf.ProcessPoolExecutor, *, broken: bool) -> None:
        """Kill the pool's processes (the only way to stop a stuck check) and forget it."""
        with self._lock:
            if self._executor is executor:
                self._executor = None
                self._breaks += int(broken)
        # concurrent.futures has no public kill: terminate the workers directly.
        for process in list(getattr(executor, "_processes", {}).values()):
            try:
                process.kill()
            except Exception:
                pass
        executor.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def run(self, chunks: list[_Chunk], timeout_s: float, retry: bool = True) -> list[list[list[int]] | None]:
        """Per chunk, its verdict codes; None for a chunk that did not finish in time."""
        executor, starting = self._get()
        if executor is None:
            return [_run_chunk_in_threads(chunk, timeout_s) for chunk in chunks]
        try:
            futures = [executor.submit(_check_chunk, chunk, timeout_s) for chunk in chunks]
        except Exception:  # e.g. a daemonic process may not have children
            logger.warning("process pool unusable; symbolic checks use threads", exc_info=True)
            self._discard(executor, broken=True)
            with self._lock:
                self._breaks = self._MAX_BREAKS
            return [_run_chunk_in_threads(chunk, timeout_s) for chunk in chunks]

        # Every pair is bounded by the in-worker alarm; this backstop only fires
        # if a worker ignores it. It assumes the worst case: all units serial.
        units = sum(len(preds) + 1 for chunk in chunks for _, preds in chunk)
        budget = self._BACKSTOP_SLACK_S + timeout_s * units + (self._STARTUP_GRACE_S if starting else 0.0)
        _, not_done = cf.wait(futures, timeout=budget)
        if not_done:
            logger.warning("symbolic check stuck past %.0fs; killing the worker pool", budget)
            self._discard(executor, broken=False)

        results: list[list[list[int]] | None] = []
        broken = []
        for i, future in enumerate(futures):
            if future in not_done:
                results.append(None)
                continue
            try:
                results.append(future.result())
                self._warm = True
            except cf.process.BrokenProcessPool:
                broken.append(i)
                results.append(None)
            except Exception:
                logger.exception("symbolic check failed")
                results.append(None)
        if broken:
            self._discard(executor, broken=True)
            if retry:  # one fresh pool for the chunks a crash took down
                retried = self.run([chunks[i] for i in broken], timeout_s, retry=False)
                for i, result in zip(broken, retried):
                    results[i] = result
        return results


def _run_chunk_in_threads(chunk: _Chunk, timeout_s: float) -> list[list[int]]:
    return [[_check_in_thread(gold, pred, timeout_s) for pred in preds] for gold, preds in chunk]


_POOL = _SymbolicPool()


def shutdown_symbolic_pool() -> None:
    """Stop the worker processes (a later check starts new ones)."""
    _POOL.shutdown()


def _symbolic_verdicts(pairs: Sequence[tuple[str, str | None]], timeout_s: float, backend: str) -> list[int]:
    """Verdict codes for unique (reference, prediction) pairs, in order."""
    if not pairs:
        return []
    if backend == "thread":
        return [_check_in_thread(g, p, timeout_s) for g, p in pairs]
    # Sort by reference so each worker parses a reference once for its group,
    # then cut into a few contiguous chunks to spread over the workers.
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
    n_chunks = min(len(order), 2 * _POOL.workers())
    bounds = [round(k * len(order) / n_chunks) for k in range(n_chunks + 1)]
    chunks, chunk_index = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        groups: dict[str, list[str | None]] = {}
        index: dict[str, list[int]] = {}
        for i in order[lo:hi]:
            gold, pred = pairs[i]
            groups.setdefault(gold, []).append(pred)
            index.setdefault(gold, []).append(i)
        chunks.append(list(groups.items()))
        chunk_index.append(list(index.values()))
    codes = [_TIMEOUT] * len(pairs)
    for result, idx_groups in zip(_POOL.run(chunks, timeout_s), chunk_index):
        if result is None:
            continue  # pool killed or crashed: scored as timeouts
        for group_codes, idxs in zip(result, idx_groups):
            for code, i in zip(group_codes, idxs):
                codes[i] = code
    return codes


# --------------------------------------------------------------------------
# Accuracy reward
# --------------------------------------------------------------------------


class AccuracyReport(NamedTuple):
    scores: list[float | None]
    fast_path: int  # decided without math-verify (plain numbers, LaTeX shortcut, no answer)
    symbolic: int  # completions sent to math-verify
    timeouts: int  # completions whose check timed out (scored 0.0)


def _reference_text(reference: Any) -> str | None:
    """The reference answer as a string: GSM8K's "#### 42" tail, or a \\boxed{} content.

    Pass references as strings: a float's repr ("1e-07") is not an answer format.
    """
    if reference is None:
        return None
    if isinstance(reference, bool) or not isinstance(reference, (str, numbers.Number)):
        return None
    s = str(reference)
    if "####" in s:
        s = s.rsplit("####", 1)[1]
    boxed = extract_boxed(s) if "\\boxed" in s else None
    s = (boxed if boxed is not None else s).strip()
    return s or None


def _prediction_text(completion: Any, answer_tags: Sequence[str]) -> str | None:
    answer = extract_answer(completion_text(completion), answer_tags)
    if answer and "\\boxed" in answer:  # <answer>… \boxed{x} …</answer>
        answer = extract_boxed(answer) or answer
    return answer or None


def check_accuracy(
    completions: Sequence[Any],
    answer: Sequence[Any],
    *,
    timeout_s: float = 2.0,
    answer_tags: Sequence[str] = ANSWER_TAGS,
    symbolic_backend: str = "thread",
) -> AccuracyReport:
    """``accuracy_reward`` plus how each completion was decided."""
    if len(answer) != len(completions):
        raise ValueError(f"answer has {len(answer)} items for {len(completions)} completions")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if symbolic_backend not in ("process", "thread"):
        raise ValueError(f"symbolic_backend must be 'process' or 'thread', got {symbolic_backend!r}")

    scores: list[float | None] = [None] * len(completions)
    pending: dict[tuple[str, str | None], list[int]] = {}  # deduplicated: G samples share answers
    fast = 0
    for i, (completion, reference) in enumerate(zip(completions, answer)):
        gold = _reference_text(reference)
        if gold is None:
            continue  # no reference: not scorable
        pred = _prediction_text(completion, answer_tags)
        if pred is None:
            if _parse_plain(gold) is not None or _latex_value(gold) is not None:  # surely parseable
                scores[i] = 0.0
                fast += 1
            else:  # 0.0 unless the reference itself turns out unparseable
                pending.setdefault((gold, None), []).append(i)
            continue
        verdict = _fast_verdict(gold, pred)
        if verdict is not None:
            scores[i] = float(verdict)
            fast += 1
        else:
            pending.setdefault((gold, pred), []).append(i)

    pairs = list(pending)
    timeouts = 0
    for pair, code in zip(pairs, _symbolic_verdicts(pairs, timeout_s, symbolic_backend)):
        for i in pending[pair]:
            scores[i] = None if code == _BAD_REFERENCE else float(code == _EQUAL)
            timeouts += code == _TIMEOUT
    return AccuracyReport(scores, fast, sum(map(len, pending.values())), timeouts)


def accuracy_reward(
    completions: Sequence[Any],
    answer: Sequence[Any],
    *,
    timeout_s: float = 2.0,
    answer_tags: Sequence[str] = ANSWER_TAGS,
    symbolic_backend: str = "thread",
    **_: Any,
) -> list[float | None]:
    """1.0 if the extracted answer equals the reference under math-verify, else 0.0.

    The answer is the last ``<answer>`` block, else the last ``\\boxed{}`` (a box
    inside the answer block is unwrapped). Decided without math-verify, with
    its verdict: plain numbers on both sides (exact comparison, or its own
    6-decimal rounding rule when a decimal is close), and simple LaTeX answers
    that are identical, equal in exact value, or provably different in value
    (see ``_fast_verdict``). Everything else goes through ``math_verify.parse`` /
    ``verify`` in a daemon thread (``symbolic_backend="thread"``, the default) or
    a worker process (``"process"``: stuck checks can be killed and checks spread
    over cores, but the calling script needs an ``if __name__ == "__main__":``
    guard since workers are started with "spawn"), at most ``timeout_s`` per
    parse+verify. A timed-out check scores 0.0 (logged); a reference that
    math-verify cannot parse scores None. Safe to call from any thread.
    """
    report = check_accuracy(
        completions, answer, timeout_s=timeout_s, answer_tags=answer_tags, symbolic_backend=symbolic_backend
    )
    if report.timeouts:
        logger.warning("accuracy_reward: %d of %d checks timed out (scored 0.0)", report.timeouts, len(completions))
    return report.scores


# --------------------------------------------------------------------------
# Language consistency (R1)
# --------------------------------------------------------------------------

_MATH_SEGMENT_RE = re.compile(r"\$\$.*?\$\$|\$[^$]*\$|\\\(.*?\\\)|\\\[.*?\\\]", re.DOTALL)


def _is_han(ch: str) -> bool:
    cp = ord(ch)
    return (
        0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF
        or 0x20000 <= cp <= 0x2EBEF or 0x30000 <= cp <= 0x3134F
    )  # fmt: skip


def _is_latin(ch: str) -> bool:
    return ch.isascii() or "LATIN" in unicodedata.name(ch, "")


def _words(text: str) -> list[str]:
    """Word-like tokens: runs of letters, each Han character on its own
    (Chinese has no spaces). Math segments, LaTeX commands and single Latin
    letters (variables like x, n) are dropped: they belong to no language."""
    text = _LATEX_COMMAND_RE.sub(" ", _MATH_SEGMENT_RE.sub(" ", text))
    words, current = [], []
    for ch in text:
        if ch.isalpha() and not _is_han(ch):
            current.append(ch)
            continue
        if current:
            words.append("".join(current))
            current = []
        if _is_han(ch):
            words.append(ch)
    if current:
        words.append("".join(current))
    return [w for w in words if not (len(w) == 1 and w.isascii())]


_LANGUAGE_TESTS: dict[str, Callable[[str], bool]] = {
    "en": lambda word: all(_is_latin(ch) for ch in word),
    "zh": lambda word: all(_is_han(ch) for ch in word),
}


def _chain_of_thought(text: str, think_tags: Sequence[str]) -> str:
    """The think block; with a prefilled opening tag, everything before the close; else all."""
    t_open, t_close = think_tags
    close = text.find(t_close)
    if close == -1:
        return text
    open_ = text.rfind(t_open, 0, close)
    return text[open_ + len(t_open) : close] if open_ != -1 else text[:close]


def language_consistency_reward(
    completions: Sequence[Any],
    *,
    language: str = "en",
    think_tags: Sequence[str] = THINK_TAGS,
    **_: Any,
) -> list[float]:
    """Share of the chain-of-thought's words that are in ``language`` (R1).

    en: words written in Latin script; zh: Han characters. A CoT with no
    countable words (empty, or only math) scores 0.0: the share is undefined,
    and dropping the reasoning must never earn this reward.
    """
    if language not in _LANGUAGE_TESTS:
        raise ValueError(f"unsupported language {language!r}; supported: {sorted(_LANGUAGE_TESTS)}")
    in_language = _LANGUAGE_TESTS[language]
    scores = []
    for completion in completions:
        words = _words(_chain_of_thought(completion_text(completion), think_tags))
        scores.append(sum(map(in_language, words)) / len(words) if words else 0.0)
    return scores


# --------------------------------------------------------------------------
# Overlong penalty (DAPO)
# --------------------------------------------------------------------------


def _soft_penalty(length: int, max_len: int, cache: int) -> float:
    if length <= max_len - cache:
        return 0.0
    if length > max_len:
        return -1.0
    return ((max_len - cache) - length) / cache


def overlong_penalty(
    completions: Sequence[Any],
    *,
    max_completion_length: int | Sequence[int] | None = None,
    soft_cache: int | None = None,
    completion_lengths: Sequence[int] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    **_: Any,
) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to (max - cache), linear to -1 at max, -1 beyond.

    Lengths are token counts: ``completion_lengths`` if given, else the length
    of ``completion_ids`` (TRL passes those), else character counts (with a
    warning: characters are not tokens). ``soft_cache`` defaults to a fifth of
    the maximum (DAPO: 4096 of 20480). Use ``make_overlong_penalty`` to fix
    the settings.
    """
    n = len(completions)
    if max_completion_length is None:
        raise ValueError("overlong_penalty needs max_completion_length (or use make_overlong_penalty)")
    if isinstance(max_completion_length, numbers.Integral):
        max_lens = [int(max_completion_length)] * n
    else:
        max_lens = [int(m) for m in max_completion_length]
    if completion_lengths is not None:
        lengths = [int(x) for x in completion_lengths]
    elif completion_ids is not None:
        lengths = [len(ids) for ids in completion_ids]
    else:
        warnings.warn(
            "overlong_penalty: no completion_lengths/completion_ids, using character counts",
            RuntimeWarning,
            stacklevel=2,
        )
        lengths = [len(completion_text(c)) for c in completions]
    if len(lengths) != n or len(max_lens) != n:
        raise ValueError("lengths must align with completions")
    scores = []
    for length, max_len in zip(lengths, max_lens):
        cache = max_len // 5 if soft_cache is None else int(soft_cache)
        if max_len <= 0 or not 0 <= cache <= max_len:
            raise ValueError(f"need 0 <= soft_cache <= max_completion_length > 0, got {cache}, {max_len}")
        scores.append(_soft_penalty(length, max_len, cache) if cache else float(-(length > max_len)))
    return scores


def make_overlong_penalty(max_completion_length: int, soft_cache: int | None = None) -> Callable[..., list[float]]:
    """``overlong_penalty`` with fixed limits, e.g. for ``score_completions(registry=...)``."""
    overlong_penalty(["x"], max_completion_length=max_completion_length, soft_cache=soft_cache, completion_lengths=[0])

    def configured(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        kwargs.update(max_completion_length=max_completion_length, soft_cache=soft_cache)
        return overlong_penalty(completions, **kwargs)

    configured.__name__ = configured.__qualname__ = "overlong_penalty"
    return configured


# --------------------------------------------------------------------------
# Registry and weighted scoring
# --------------------------------------------------------------------------

REWARD_FUNCTIONS: dict[str, Callable[..., list[float | None]]] = {
    "format": format_reward,
    "format_strict": format_reward_strict,
    "accuracy": accuracy_reward,
    "tag_count": tag_count_reward,
    "language_consistency": language_consistency_reward,
    "overlong": overlong_penalty,  # needs max_completion_length: see make_overlong_penalty
}


class UnknownRewardError(KeyError, ValueError):
    """A reward spec names a function the registry does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclasses.dataclass(frozen=True)
class RewardScores:
    per_function: dict[str, list[float | None]]  # None: the function does not apply, or it failed
    total: list[float]  # sum of weight * score, a None counting as 0.0
    failures: dict[str, int]  # completions each function failed on (raised, NaN/inf/non-number, wrong length)
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)  # completions it returned None for


def _normalize_specs(
    reward_specs: Mapping[str, float] | Iterable[tuple[str, float]], registry: Mapping[str, Callable]
) -> list[tuple[str, float]]:
    """[(name, weight)], validated; raises before anything is scored."""
    items = list(reward_specs.items() if isinstance(reward_specs, Mapping) else reward_specs)
    if not all(isinstance(item, (tuple, list)) and len(item) == 2 for item in items):
        raise ValueError(f"reward specs must be {{name: weight}} or [(name, weight), ...], got {reward_specs!r}")
    names = [name for name, _ in items]
    unknown = [name for name in names if name not in registry]
    if unknown:
        raise UnknownRewardError(f"unknown reward function(s) {unknown}; known: {sorted(registry)}")
    if len(set(names)) != len(names):
        raise ValueError(f"reward listed twice: {names}")
    for name, weight in items:
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"weight for {name!r} must be a finite number, got {weight!r}")
    return [(name, float(weight)) for name, weight in items]


_FAILED = object()  # a score that could not be had, as opposed to a function's own None ("does not apply")


def _clean_score(value: Any) -> Any:
    """A finite float; None for None (the function does not apply); _FAILED for NaN/inf/non-numbers.

    0-d arrays/tensors are unwrapped.
    """
    if value is None:
        return None
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()
        except Exception:
            return _FAILED
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else _FAILED
    return _FAILED


def _call_reward(
    fn: Callable, completions: list, columns: Mapping[str, Any], log_level: int = logging.WARNING
) -> list[Any] | None:
    """The function's cleaned scores (see _clean_score), or None if it raised. Wrong length: all _FAILED."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        raw = list(fn(completions, **columns))
    except Exception:
        logger.log(log_level, "reward %s raised", name, exc_info=True)
        return None
    if len(raw) != len(completions):
        logger.warning("reward %s returned %d scores for %d completions", name, len(raw), len(completions))
        return [_FAILED] * len(completions)
    return [_clean_score(v) for v in raw]


def _score_one_function(fn: Callable, completions: list, columns: Mapping[str, Any]) -> list[Any]:
    """Whole batch first; if that raises, completion by completion so a bad one fails alone."""
    scores = _call_reward(fn, completions, columns)
    if scores is not None:
        return scores
    n = len(completions)
    out: list[Any] = []
    for i in range(n):
        # Aligned columns are sliced; anything else (a scalar setting) is passed as is.
        single_columns = {
            k: [v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in columns.items()
        }
        single = _call_reward(fn, [completions[i]], single_columns, log_level=logging.DEBUG)
        out.append(single[0] if single else _FAILED)
    return out


def score_completions(
    completions: Sequence[Any],
    reward_specs: Mapping[str, float] | Iterable[tuple[str, float]],
    columns: Mapping[str, Any] | None = None,
    *,
    registry: Mapping[str, Callable[..., list[float | None]]] | None = None,
) -> RewardScores:
    """Run the named reward functions and combine them with their weights.

    ``reward_specs``: {name: weight} or [(name, weight), ...], names from
    ``registry`` (default ``REWARD_FUNCTIONS``). ``columns``: dataset columns,
    passed to every function as keyword arguments.

    Bad specs (unknown name, duplicate, non-finite weight) and columns that do
    not align with the completions raise ValueError (unknown names:
    UnknownRewardError, also a KeyError) before anything is scored. After that
    nothing raises: a score is None when its function returned None (it does
    not apply to that completion, counted in ``skipped``), raised for it,
    returned NaN/inf/a non-number, or returned the wrong number of scores
    (then all its scores are None); the last three are counted in
    ``failures``. A None adds 0.0 to ``total``, so a failure never poisons the
    other rewards with NaN.
    """
    registry = REWARD_FUNCTIONS if registry is None else registry
    specs = _normalize_specs(reward_specs, registry)
    completions = list(completions)
    columns = dict(columns or {})
    if "completions" in columns:
        raise ValueError("'completions' cannot be a column name")
    for name, values in columns.items():
        if isinstance(values, (list, tuple)) and len(values) != len(completions):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(completions)} completions")

    per_function: dict[str, list[float | None]] = {}
    failures: dict[str, int] = {}
    skipped: dict[str, int] = {}
    total = [0.0] * len(completions)
    for name, weight in specs:
        raw = _score_one_function(registry[name], completions, columns)
        failures[name] = sum(s is _FAILED for s in raw)
        skipped[name] = sum(s is None for s in raw)
        scores = [None if s is _FAILED else s for s in raw]
        per_function[name] = scores
        for i, s in enumerate(scores):
            if s is not None:
                total[i] += weight * s
    return RewardScores(per_function=per_function, total=total, failures=failures, skipped=skipped)
