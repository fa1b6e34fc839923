"""A small LaTeX arithmetic engine: values at a probe point and exact canonical forms of answers in a subset.

Used by `math_fast` to decide equal/different without sympy. Pure Python; must not depend on torch.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from grpo.rewards.answers import LATEX_COMMAND_RE, strip_answer_wrapping

# A small LaTeX arithmetic subset (numbers, single-letter variables, \pi, + - * /
# \cdot \times, implicit products, ^, \frac, \sqrt, parentheses), read by one
# parser and evaluated two ways:
# * in floats at a fixed positive point (_FloatArithmetic), to prove two answers
#   DIFFERENT (see _clearly_different for why that implies math-verify's False);
# * exactly, as a canonical sum of terms (_Exact), to prove them EQUAL (see
#   fast_verdict for why that implies math-verify's True).
# tests/grpo/rewards/test_rewards.py checks both readings against math-verify's own parse and
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
    s = strip_answer_wrapping(text)
    if not s or len(s) > _MAX_LATEX_CHARS or re.search(r"[A-Za-z]{3,}", LATEX_COMMAND_RE.sub(" ", s)):
        return None  # 3+ letters in a row may read as prose to prepare_for_math_verify
    try:
        tokens = _tokenize_latex(s)
        if len(tokens) == 1 and tokens[0][0] == "var":
            return None
        return _LatexReader(tokens, arithmetic).value()
    except (_NotInSubset, ArithmeticError, ValueError, RecursionError):
        return None


def latex_value(text: str) -> float | None:
    """The value of a LaTeX answer in the subset at the probe point, else None."""
    v = _read_latex(text, _FloatArithmetic)
    return v if isinstance(v, float) and math.isfinite(v) else None


def latex_exact(text: str) -> _Exact | None:
    """The exact value of a LaTeX answer in the exact part of the subset, else None."""
    return _read_latex(text, _ExactArithmetic)
