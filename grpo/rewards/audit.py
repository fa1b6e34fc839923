"""A labelled set for auditing answer checkers: pairs of a reference and a completion's answer, each marked equivalent
or not, in the forms graders miss (fractions against decimals, percentages, LaTeX spellings, units, intervals, sets,
expressions, thousands separators, GSM8K's "#### n" tails, answers in `\\boxed{}`, currency, scientific notation,
"x = n", degrees, signed fractions, mixed numbers; and, added once the rule read them, plain e-notation, thousands
split by spaces, plain mixed numbers "3 1/2", numbers in words, one-word answers).

Built here, from templates and a seeded generator, not copied from any dataset. Each pair's label follows from how it
was built: an equivalent pair writes one value two ways; a non-equivalent pair changes the value (or an endpoint, an
element, a coefficient) while keeping the form, so a checker cannot pass by comparing shapes.

Each pair says when it was added against the rule (`Pair.added`): `before_tuning` for the 15 forms the rule already
read when the set was written (16 forms at 181529a; the rule before that commit passes every one of these pairs and
fails none of their non-equivalent ones), `after_tuning` for the six the rule was changed to read once their pairs
showed it missing them (`TUNED_FOR`: currency in 181529a, the five forms of 102f75a). Neither group is held out
from the rule: a form is in the first because the rule already passed its pairs, in the second because the rule was
changed until it did, so the rule passed both by how the split was made (`SPLIT_NOTE`, printed under the figures).
Its figures on the set show that later changes kept every form, not how it does on forms nobody checked it against.
Other checkers (math-verify) were tuned on neither group.

`read_rows` reads a user's own labelled rows (JSONL of {reference, answer, equal}) into the same pairs.
`grpo.training.verifier_audit` scores checkers on either; `r1 audit-rewards` and `benchmarks/reward_audit.py` print
it.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple


BEFORE_TUNING = "before_tuning"  # the rule read the form as it stood when the pairs were written (why it is here)
AFTER_TUNING = "after_tuning"  # the rule was changed to read the form once these pairs showed it missing them
# said wherever the shipped set's figures are printed: a reader takes a group named "before tuning" for held out
SPLIT_NOTE = (f"{BEFORE_TUNING}: the forms the rule already read when their pairs were written; {AFTER_TUNING}: "
              "those it was then changed to read. The rule passed both by how the split was made: its figures on "
              "them check that it still does, they are not held out")

# the forms the rule was changed to read after their pairs were written, and the commit that changed it; the rule of
# 181529a^ (before the set) misses every pair of these and none of the others' (recall 1.000 on the other 392)
TUNED_FOR = {"currency": "181529a", "e_notation": "102f75a", "spaced_thousands": "102f75a",
             "plain_mixed_numbers": "102f75a", "number_words": "102f75a", "word_answers": "102f75a"}


class Pair(NamedTuple):
    reference: str  # as a dataset holds it
    completion: str  # a completion that gives the answer (a user's row: the answer as given)
    equivalent: bool  # the label
    kind: str  # which form it tests ("" where a user's row names none)
    added: str = ""  # BEFORE_TUNING or AFTER_TUNING in the shipped set; a user's row: its own `added`, else ""


def _completion(answer: str, rng: random.Random) -> str:
    """The answer inside a completion: in the answer tags, in a box inside them, or boxed at the end of the text."""
    way = rng.randrange(3)
    if way == 0:
        return f"<think>working it out</think><answer>{answer}</answer>"
    if way == 1:
        return f"<think>so</think><answer>The answer is $\\boxed{{{answer}}}$.</answer>"
    return f"Working it out step by step, the result is $\\boxed{{{answer}}}$."


# A form's pairs come in rounds: each draws its values and writes them as (reference, answer, equivalent) triples;
# FORMS says how many rounds a form gets, and `audit_pairs` makes them all from one generator.
Triple = tuple[str, str, bool]


def _fractions(rng: random.Random) -> list[Triple]:
    den = rng.choice([2, 4, 5, 8, 10, 20, 25])
    num = rng.randrange(1, 3 * den)
    if math.gcd(num, den) != 1:
        num += 1 if math.gcd(num + 1, den) == 1 else 0
    value = Fraction(num, den)
    decimal, latex = f"{float(value):g}", f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    wrong = value + Fraction(1, value.denominator)
    return [(latex, decimal, True), (decimal, f"{value.numerator}/{value.denominator}", True),
            (latex, f"{float(wrong):g}", False)]


def _percentages(rng: random.Random) -> list[Triple]:
    p = rng.randrange(1, 100)
    return [(f"{p}\\%", f"{p}", True), (f"{p}", f"{p}\\%", True), (f"{p}\\%", f"{p + rng.randrange(1, 9)}\\%", False)]


def _latex_forms(rng: random.Random) -> list[Triple]:
    a, b = rng.randrange(1, 9), rng.randrange(2, 10)
    if math.gcd(a, b) != 1:
        b += 1
    k = rng.randrange(2, 7)
    return [(f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", True),
            (f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{a * k}}}{{{b * k}}}", True),
            (f"{k}\\sqrt{{2}}", f"\\sqrt{{{2 * k * k}}}", True),
            (f"\\frac{{{a}}}{{{b}}}", f"\\frac{{{b}}}{{{a}}}", a == b),
            (f"{k}\\pi", f"{k} \\pi", True),
            (f"{k}\\sqrt{{2}}", f"{k}\\sqrt{{3}}", False)]


def _units(rng: random.Random) -> list[Triple]:
    n = rng.randrange(2, 500)
    unit = rng.choice(["cm", "kg", "dollars", "meters", "apples", "minutes"])
    return [(f"{n}", f"{n} {unit}", True), (f"{n} \\text{{ {unit}}}", f"{n}", True),
            (f"{n}", f"{n + rng.randrange(1, 20)} {unit}", False)]


def _intervals(rng: random.Random) -> list[Triple]:
    a = rng.randrange(-9, 5)
    b = a + rng.randrange(1, 9)
    return [(f"({a}, {b}]", f"({a},{b}]", True), (f"[{a}, {b}]", f"\\left[{a}, {b}\\right]", True),
            (f"[{a}, {b}]", f"({a}, {b})", False), (f"({a}, \\infty)", f"({a}, \\infty)", True),
            (f"({a}, \\infty)", f"[{a}, \\infty)", False)]


def _sets(rng: random.Random) -> list[Triple]:
    items = rng.sample(range(-9, 10), 3)
    shuffled = items[:]
    rng.shuffle(shuffled)
    show = lambda xs: "\\{" + ", ".join(map(str, xs)) + "\\}"  # noqa: E731
    return [(show(items), show(shuffled), True), (show(items), show(items[:2] + [items[2] + 20]), False)]


def _expressions(rng: random.Random) -> list[Triple]:
    a = rng.randrange(1, 6)
    return [(f"(x+{a})^2", f"x^2+{2 * a}x+{a * a}", True), (f"{2 * a}x", f"{a}x+{a}x", True),
            (f"(x+{a})^2", f"x^2+{a}x+{a * a}", False), (f"x^{a + 1}", f"{a + 1}x", False)]


def _thousands_separators(rng: random.Random) -> list[Triple]:
    n = rng.randrange(1000, 10**7)
    return [(f"{n}", f"{n:,}", True), (f"{n:,}", f"{n}", True), (f"{n:,}", f"{n // 10}", False)]


def _gsm8k_tails(rng: random.Random) -> list[Triple]:
    n = rng.randrange(1, 5000)
    return [(f"She buys 3 more, so {n - 3} + 3 = {n}.\n#### {n}", f"{n}", True), (f"#### {n:,}", f"{n}", True),
            (f"So the total is {n}.\n#### {n}", f"{n + 1}", False)]


def _boxed(rng: random.Random) -> list[Triple]:
    n = rng.randrange(2, 99)
    return [(f"\\boxed{{{n}}}", f"{n}", True), (f"{n}", f"\\boxed{{{n}}}", True),
            (f"\\boxed{{\\frac{{1}}{{{n}}}}}", f"\\frac{{1}}{{{n + 1}}}", False)]


def _currency(rng: random.Random) -> list[Triple]:
    cents = rng.randrange(100, 100000)
    dollars = f"{cents // 100}.{cents % 100:02d}"
    return [(f"\\${dollars}", f"{float(dollars):g}", True), (f"{float(dollars):g}", f"\\${dollars}", True),
            (f"\\${dollars}", f"\\${float(dollars) + 1:.2f}", False)]


def _scientific_notation(rng: random.Random) -> list[Triple]:
    m, e = rng.randrange(11, 99) / 10, rng.randrange(2, 6)
    value = round(m * 10**e)
    return [(f"{value}", f"{m:g} \\times 10^{{{e}}}", True), (f"{m:g} \\times 10^{{{e}}}", f"{value}", True),
            (f"{value}", f"{m:g} \\times 10^{{{e + 1}}}", False)]


def _equations(rng: random.Random) -> list[Triple]:
    n = rng.randrange(-20, 50)
    var = rng.choice("xyznk")
    return [(f"{n}", f"{var} = {n}", True), (f"{var} = {n}", f"{n}", True),
            (f"{var} = {n}", f"{var} = {n + 2}", False)]


def _degrees(rng: random.Random) -> list[Triple]:
    d = rng.randrange(5, 180)
    return [(f"{d}^\\circ", f"{d}", True), (f"{d}", f"{d}^{{\\circ}}", True), (f"{d}^\\circ", f"{d + 5}^\\circ", False)]


def _signed_fractions(rng: random.Random) -> list[Triple]:
    a, b = rng.randrange(1, 9), rng.randrange(2, 11)
    if math.gcd(a, b) != 1:
        a = 1
    latex = f"-\\frac{{{a}}}{{{b}}}"
    return [(latex, f"\\frac{{-{a}}}{{{b}}}", True),
            (latex, f"{-a / b:g}" if len(f"{a / b:g}") < 8 else f"-{a}/{b}", True),
            (latex, f"\\frac{{{a}}}{{{b}}}", False)]


def _mixed_numbers(rng: random.Random) -> list[Triple]:
    whole, den = rng.randrange(1, 9), rng.choice([2, 3, 4, 5])
    num = rng.randrange(1, den)
    improper = Fraction(whole * den + num, den)
    latex = f"\\frac{{{improper.numerator}}}{{{improper.denominator}}}"
    return [(latex, f"{whole}\\frac{{{num}}}{{{den}}}", True), (f"{whole} \\frac{{{num}}}{{{den}}}", latex, True),
            (f"{whole}\\frac{{{num}}}{{{den}}}", f"{whole + 1}\\frac{{{num}}}{{{den}}}", False)]


_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                 "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS_WORDS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def _in_words(n: int) -> str:
    if n < 20:
        return _NUMBER_WORDS[n]
    tens, units = divmod(n, 10)
    return _TENS_WORDS[tens - 2] + (f"-{_NUMBER_WORDS[units]}" if units else "")


def _e_notation(rng: random.Random) -> list[Triple]:
    m, e = rng.randrange(11, 99) / 10, rng.randrange(2, 6)
    value = round(m * 10**e)
    return [(f"{value}", f"{m:g}e{e}", True), (f"{m:g}E+{e:02d}", f"{value}", True),
            (f"{value}", f"{m:g}e{e + 1}", False)]


def _spaced_thousands(rng: random.Random) -> list[Triple]:
    n = rng.randrange(1000, 10**7)
    spaced = f"{n:,}".replace(",", rng.choice([" ", "\\,", "\\ "]))
    return [(f"{n}", spaced, True), (spaced, f"{n}", True), (spaced, f"{n + rng.randrange(1, 9) * 1000}", False)]


def _plain_mixed_numbers(rng: random.Random) -> list[Triple]:
    whole, den = rng.randrange(1, 9), rng.choice([2, 3, 4, 5])
    num = rng.randrange(1, den)
    improper = Fraction(whole * den + num, den)
    return [(f"\\frac{{{improper.numerator}}}{{{improper.denominator}}}", f"{whole} {num}/{den}", True),
            (f"{whole} {num}/{den}", f"{float(improper):g}" if den in (2, 4, 5) else f"{improper}", True),
            (f"{whole} {num}/{den}", f"{whole + 1} {num}/{den}", False)]


def _number_words(rng: random.Random) -> list[Triple]:
    n = rng.randrange(0, 100)
    words = _in_words(n)
    return [(f"{n}", rng.choice([words, words.capitalize(), words.replace("-", " ")]), True), (words, f"{n}", True),
            (f"{n}", _in_words((n + rng.randrange(1, 9)) % 100), False)]


_WORD_ANSWERS = ["Monday", "Tuesday", "yes", "no", "blue", "Alice", "even", "odd", "triangle", "square", "north",
                 "impossible", "undefined", "always", "never"]


def _word_answers(rng: random.Random) -> list[Triple]:
    w, other = rng.sample(_WORD_ANSWERS, 2)
    return [(rng.choice([w, f"\\text{{{w}}}"]), rng.choice([w.lower(), w.upper(), f"\\text{{{w}}}", f"{w}."]), True),
            (f"\\text{{{w}}}", w.capitalize(), True), (w, rng.choice([other, f"\\text{{{other}}}"]), False)]


# each form: the rounds it gets and the round that draws them, in the order the set is built (one seeded generator
# through all of them, so the order is part of the set)
FORMS: dict[str, tuple[int, Callable[[random.Random], list[Triple]]]] = {
    "fractions_and_decimals": (12, _fractions),
    "percentages": (10, _percentages),
    "latex_forms": (8, _latex_forms),
    "units": (8, _units),
    "intervals": (6, _intervals),
    "sets": (6, _sets),
    "expressions": (8, _expressions),
    "thousands_separators": (10, _thousands_separators),
    "gsm8k_tails": (10, _gsm8k_tails),
    "boxed": (8, _boxed),
    "currency": (8, _currency),
    "scientific_notation": (6, _scientific_notation),
    "equations": (8, _equations),
    "degrees": (6, _degrees),
    "signed_fractions": (6, _signed_fractions),
    "mixed_numbers": (6, _mixed_numbers),
    "e_notation": (6, _e_notation),
    "spaced_thousands": (6, _spaced_thousands),
    "plain_mixed_numbers": (6, _plain_mixed_numbers),
    "number_words": (6, _number_words),
    "word_answers": (6, _word_answers),
}


def audit_pairs(seed: int = 0) -> list[Pair]:
    """The labelled set: every form's rounds of pairs, then each answer put in a completion; the same `seed`, the
    same set."""
    rng = random.Random(seed)
    pairs = []
    for kind, (rounds, draw) in FORMS.items():
        triples = [triple for _ in range(rounds) for triple in draw(rng)]  # a form's values, then its completions
        added = AFTER_TUNING if kind in TUNED_FOR else BEFORE_TUNING
        pairs += [Pair(reference, _completion(answer, rng), equivalent, kind, added)
                  for reference, answer, equivalent in triples]
    return pairs


class AuditFileError(ValueError):
    """A row of a user's audit file that is not {reference, answer, equal}: says the file, the row and the field."""


_FIELDS = {"reference": "a string", "answer": "a string", "equal": "true or false"}


def read_rows(path: str | Path) -> list[Pair]:
    """A user's labelled rows from a JSONL file, one JSON object a line: `reference` (a string; a number is read as
    its text), `answer` (a completion, or the bare answer), `equal` (true or false), and optionally `kind` and
    `added` (strings the report groups by). Blank lines are skipped; rows are counted from 1 by line.

    Every row is read before any is graded, so a bad one fails at once, naming the file, its row and its field.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AuditFileError(f"{path}: cannot read it ({e})") from None
    pairs = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise AuditFileError(f"{path}: row {n}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise AuditFileError(f"{path}: row {n}: expected a JSON object with {', '.join(_FIELDS)}, got "
                                 f"{type(row).__name__}")
        for field, expected in _FIELDS.items():
            if field not in row:
                raise AuditFileError(f"{path}: row {n}: no field {field!r} (each row needs {', '.join(_FIELDS)})")
            value = row[field]
            ok = (isinstance(value, bool) if field == "equal" else
                  isinstance(value, str) or (field == "reference" and isinstance(value, (int, float))
                                             and not isinstance(value, bool)))
            if not ok:
                raise AuditFileError(f"{path}: row {n}: field {field!r} must be {expected}, got "
                                     f"{json.dumps(value)[:60]}")
        for field in ("kind", "added"):
            if not isinstance(row.get(field, ""), str):
                raise AuditFileError(f"{path}: row {n}: field {field!r} must be a string, got "
                                     f"{json.dumps(row[field])[:60]}")
        pairs.append(Pair(str(row["reference"]), row["answer"], row["equal"], row.get("kind", ""),
                          row.get("added", "")))
    if not pairs:
        raise AuditFileError(f"{path}: holds no rows")
    return pairs


