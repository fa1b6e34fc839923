"""A labelled set for auditing answer checkers: pairs of a reference and a completion's answer, each marked equivalent
or not, in the forms graders miss (fractions against decimals, percentages, LaTeX spellings, units, intervals, sets,
expressions, thousands separators, GSM8K's "#### n" tails, answers in `\\boxed{}`, currency, scientific notation,
"x = n", degrees, signed fractions, mixed numbers; and, added once the rule read them, plain e-notation, thousands
split by spaces, plain mixed numbers "3 1/2", numbers in words, one-word answers).

Built here, from templates and a seeded generator, not copied from any dataset. Each pair's label follows from how it
was built: an equivalent pair writes one value two ways; a non-equivalent pair changes the value (or an endpoint, an
element, a coefficient) while keeping the form, so a checker cannot pass by comparing shapes.

`audit(check)` scores a checker (`check(references, completions) -> list[bool | None]`, None: it could not say) and
returns precision and recall over the pairs, by kind too. `benchmarks/reward_audit.py` prints them for the accuracy
reward and for plain math-verify.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NamedTuple


class Pair(NamedTuple):
    reference: str  # as a dataset holds it
    completion: str  # a completion that gives the answer
    equivalent: bool  # the label
    kind: str  # which form it tests


def _completion(answer: str, rng: random.Random) -> str:
    """The answer inside a completion: in the answer tags, in a box inside them, or boxed at the end of the text."""
    way = rng.randrange(3)
    if way == 0:
        return f"<think>working it out</think><answer>{answer}</answer>"
    if way == 1:
        return f"<think>so</think><answer>The answer is $\\boxed{{{answer}}}$.</answer>"
    return f"Working it out step by step, the result is $\\boxed{{{answer}}}$."


def _thousands(n: int) -> str:
    return f"{n:,}"


def _fraction_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(12):
        den = rng.choice([2, 4, 5, 8, 10, 20, 25])
        num = rng.randrange(1, 3 * den)
        if math.gcd(num, den) != 1:
            num += 1 if math.gcd(num + 1, den) == 1 else 0
        value = Fraction(num, den)
        decimal = f"{float(value):g}"
        out.append((f"\\frac{{{value.numerator}}}{{{value.denominator}}}", decimal, True))
        out.append((decimal, f"{value.numerator}/{value.denominator}", True))
        wrong = value + Fraction(1, value.denominator)
        out.append((f"\\frac{{{value.numerator}}}{{{value.denominator}}}", f"{float(wrong):g}", False))
    return out


def _percent_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(10):
        p = rng.randrange(1, 100)
        out.append((f"{p}\\%", f"{p}", True))
        out.append((f"{p}", f"{p}\\%", True))
        out.append((f"{p}\\%", f"{p + rng.randrange(1, 9)}\\%", False))
    return out


def _latex_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(8):
        a, b = rng.randrange(1, 9), rng.randrange(2, 10)
        if math.gcd(a, b) != 1:
            b += 1
        k = rng.randrange(2, 7)
        out.append((f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", True))
        out.append((f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{a * k}}}{{{b * k}}}", True))
        out.append((f"{k}\\sqrt{{2}}", f"\\sqrt{{{2 * k * k}}}", True))
        out.append((f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{b}}}{{{a}}}", a == b))
        out.append((f"{k}\\pi", f"{k} \\pi", True))
        out.append((f"{k}\\sqrt{{2}}", f"{k}\\sqrt{{3}}", False))
    return out


def _unit_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(8):
        n = rng.randrange(2, 500)
        unit = rng.choice(["cm", "kg", "dollars", "meters", "apples", "minutes"])
        out.append((f"{n}", f"{n} {unit}", True))
        out.append((f"{n} \\text{{ {unit}}}", f"{n}", True))
        out.append((f"{n}", f"{n + rng.randrange(1, 20)} {unit}", False))
    return out


def _interval_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        a = rng.randrange(-9, 5)
        b = a + rng.randrange(1, 9)
        out.append((f"({a}, {b}]", f"({a},{b}]", True))
        out.append((f"[{a}, {b}]", f"\\left[{a}, {b}\\right]", True))
        out.append((f"[{a}, {b}]", f"({a}, {b})", False))
        out.append((f"({a}, \\infty)", f"({a}, \\infty)", True))
        out.append((f"({a}, \\infty)", f"[{a}, \\infty)", False))
    return out


def _set_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        items = rng.sample(range(-9, 10), 3)
        shuffled = items[:]
        rng.shuffle(shuffled)
        show = lambda xs: "\\{" + ", ".join(map(str, xs)) + "\\}"  # noqa: E731
        out.append((show(items), show(shuffled), True))
        changed = items[:2] + [items[2] + 20]
        out.append((show(items), show(changed), False))
    return out


def _expression_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(8):
        a = rng.randrange(1, 6)
        out.append((f"(x+{a})^2", f"x^2+{2 * a}x+{a * a}", True))
        out.append((f"{2 * a}x", f"{a}x+{a}x", True))
        out.append((f"(x+{a})^2", f"x^2+{a}x+{a * a}", False))
        out.append((f"x^{a + 1}", f"{a + 1}x", False))
    return out


def _thousands_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(10):
        n = rng.randrange(1000, 10**7)
        out.append((f"{n}", _thousands(n), True))
        out.append((_thousands(n), f"{n}", True))
        out.append((_thousands(n), f"{n // 10}", False))
    return out


def _gsm8k_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(10):
        n = rng.randrange(1, 5000)
        out.append((f"She buys 3 more, so {n - 3} + 3 = {n}.\n#### {n}", f"{n}", True))
        out.append((f"#### {_thousands(n)}", f"{n}", True))
        out.append((f"So the total is {n}.\n#### {n}", f"{n + 1}", False))
    return out


def _boxed_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(8):
        n = rng.randrange(2, 99)
        out.append((f"\\boxed{{{n}}}", f"{n}", True))
        out.append((f"{n}", f"\\boxed{{{n}}}", True))
        out.append((f"\\boxed{{\\frac{{1}}{{{n}}}}}", f"\\frac{{1}}{{{n + 1}}}", False))
    return out


def _currency_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(8):
        cents = rng.randrange(100, 100000)
        dollars = f"{cents // 100}.{cents % 100:02d}"
        out.append((f"\\${dollars}", f"{float(dollars):g}", True))
        out.append((f"{float(dollars):g}", f"\\${dollars}", True))
        out.append((f"\\${dollars}", f"\\${float(dollars) + 1:.2f}", False))
    return out


def _scientific_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        m, e = rng.randrange(11, 99) / 10, rng.randrange(2, 6)
        value = round(m * 10**e)
        out.append((f"{value}", f"{m:g} \\times 10^{{{e}}}", True))
        out.append((f"{m:g} \\times 10^{{{e}}}", f"{value}", True))
        out.append((f"{value}", f"{m:g} \\times 10^{{{e + 1}}}", False))
    return out


def _equation_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(8):
        n = rng.randrange(-20, 50)
        var = rng.choice("xyznk")
        out.append((f"{n}", f"{var} = {n}", True))
        out.append((f"{var} = {n}", f"{n}", True))
        out.append((f"{var} = {n}", f"{var} = {n + 2}", False))
    return out


def _degree_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        d = rng.randrange(5, 180)
        out.append((f"{d}^\\circ", f"{d}", True))
        out.append((f"{d}", f"{d}^{{\\circ}}", True))
        out.append((f"{d}^\\circ", f"{d + 5}^\\circ", False))
    return out


def _signed_fraction_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        a, b = rng.randrange(1, 9), rng.randrange(2, 11)
        if math.gcd(a, b) != 1:
            a = 1
        out.append((f"-\\frac{{{a}}}{{{b}}}", f"\\frac{{-{a}}}{{{b}}}", True))
        out.append((f"-\\frac{{{a}}}{{{b}}}", f"{-a / b:g}" if len(f"{a / b:g}") < 8 else f"-{a}/{b}", True))
        out.append((f"-\\frac{{{a}}}{{{b}}}", f"\\frac{{{a}}}{{{b}}}", False))
    return out


def _mixed_number_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        whole, den = rng.randrange(1, 9), rng.choice([2, 3, 4, 5])
        num = rng.randrange(1, den)
        improper = Fraction(whole * den + num, den)
        out.append((f"\\frac{{{improper.numerator}}}{{{improper.denominator}}}", f"{whole}\\frac{{{num}}}{{{den}}}",
                    True))
        out.append((f"{whole} \\frac{{{num}}}{{{den}}}", f"\\frac{{{improper.numerator}}}{{{improper.denominator}}}",
                    True))
        out.append((f"{whole}\\frac{{{num}}}{{{den}}}", f"{whole + 1}\\frac{{{num}}}{{{den}}}", False))
    return out


_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS_WORDS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def _in_words(n: int) -> str:
    if n < 20:
        return _NUMBER_WORDS[n]
    tens, units = divmod(n, 10)
    return _TENS_WORDS[tens - 2] + (f"-{_NUMBER_WORDS[units]}" if units else "")


def _e_notation_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        m, e = rng.randrange(11, 99) / 10, rng.randrange(2, 6)
        value = round(m * 10**e)
        out.append((f"{value}", f"{m:g}e{e}", True))
        out.append((f"{m:g}E+{e:02d}", f"{value}", True))
        out.append((f"{value}", f"{m:g}e{e + 1}", False))
    return out


def _spaced_thousands_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        n = rng.randrange(1000, 10**7)
        spaced = _thousands(n).replace(",", rng.choice([" ", "\\,", "\\ "]))
        out.append((f"{n}", spaced, True))
        out.append((spaced, f"{n}", True))
        out.append((spaced, f"{n + rng.randrange(1, 9) * 1000}", False))
    return out


def _plain_mixed_number_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        whole, den = rng.randrange(1, 9), rng.choice([2, 3, 4, 5])
        num = rng.randrange(1, den)
        improper = Fraction(whole * den + num, den)
        out.append((f"\\frac{{{improper.numerator}}}{{{improper.denominator}}}", f"{whole} {num}/{den}", True))
        out.append((f"{whole} {num}/{den}", f"{float(improper):g}" if den in (2, 4, 5) else f"{improper}", True))
        out.append((f"{whole} {num}/{den}", f"{whole + 1} {num}/{den}", False))
    return out


def _number_word_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    out = []
    for _ in range(6):
        n = rng.randrange(0, 100)
        words = _in_words(n)
        out.append((f"{n}", rng.choice([words, words.capitalize(), words.replace("-", " ")]), True))
        out.append((words, f"{n}", True))
        out.append((f"{n}", _in_words((n + rng.randrange(1, 9)) % 100), False))
    return out


def _word_answer_pairs(rng: random.Random) -> list[tuple[str, str, bool]]:
    words = ["Monday", "Tuesday", "yes", "no", "blue", "Alice", "even", "odd", "triangle", "square", "north",
             "impossible", "undefined", "always", "never"]
    out = []
    for _ in range(6):
        w, other = rng.sample(words, 2)
        out.append((rng.choice([w, f"\\text{{{w}}}"]), rng.choice([w.lower(), w.upper(), f"\\text{{{w}}}", f"{w}."]),
                    True))
        out.append((f"\\text{{{w}}}", w.capitalize(), True))
        out.append((w, rng.choice([other, f"\\text{{{other}}}"]), False))
    return out


KINDS: dict[str, Callable[[random.Random], list[tuple[str, str, bool]]]] = {
    "fractions_and_decimals": _fraction_pairs,
    "percentages": _percent_pairs,
    "latex_forms": _latex_pairs,
    "units": _unit_pairs,
    "intervals": _interval_pairs,
    "sets": _set_pairs,
    "expressions": _expression_pairs,
    "thousands_separators": _thousands_pairs,
    "gsm8k_tails": _gsm8k_pairs,
    "boxed": _boxed_pairs,
    "currency": _currency_pairs,
    "scientific_notation": _scientific_pairs,
    "equations": _equation_pairs,
    "degrees": _degree_pairs,
    "signed_fractions": _signed_fraction_pairs,
    "mixed_numbers": _mixed_number_pairs,
    "e_notation": _e_notation_pairs,
    "spaced_thousands": _spaced_thousands_pairs,
    "plain_mixed_numbers": _plain_mixed_number_pairs,
    "number_words": _number_word_pairs,
    "word_answers": _word_answer_pairs,
}


def audit_pairs(seed: int = 0) -> list[Pair]:
    """The labelled set: every kind's pairs, each answer put in a completion; the same `seed`, the same set."""
    rng = random.Random(seed)
    pairs = []
    for kind, make in KINDS.items():
        for reference, answer, equivalent in make(rng):
            pairs.append(Pair(reference, _completion(answer, rng), equivalent, kind))
    return pairs


class AuditResult(NamedTuple):
    precision: float  # of the pairs the checker accepted, the share that are equivalent
    recall: float  # of the equivalent pairs, the share it accepted
    accepted: int
    positives: int
    undecided: int  # pairs it could not say anything about (None): counted as not accepted
    by_kind: dict[str, tuple[float, float]]  # kind -> (precision, recall)


def _scores(pairs: Sequence[Pair], said: Sequence[bool | None]) -> tuple[float, float, int, int]:
    accepted = [p for p, s in zip(pairs, said) if s]
    positives = [p for p in pairs if p.equivalent]
    true = sum(p.equivalent for p in accepted)
    precision = true / len(accepted) if accepted else math.nan
    recall = true / len(positives) if positives else math.nan
    return precision, recall, len(accepted), len(positives)


def audit(check: Callable[[list[str], list[str]], list[bool | None]], pairs: Sequence[Pair]) -> AuditResult:
    """Precision and recall of `check` (references, completions -> accepted or not, None undecided) on `pairs`."""
    said = check([p.reference for p in pairs], [p.completion for p in pairs])
    precision, recall, accepted, positives = _scores(pairs, said)
    by_kind = {}
    for kind in dict.fromkeys(p.kind for p in pairs):
        rows = [i for i, p in enumerate(pairs) if p.kind == kind]
        by_kind[kind] = _scores([pairs[i] for i in rows], [said[i] for i in rows])[:2]
    return AuditResult(precision, recall, accepted, positives, sum(s is None for s in said), by_kind)
