"""The synthetic reasoning task: multi-step arithmetic word problems with worked chains of thought.

In the spirit of the R1 notes' example ("Mr. Curtis has 325 chickens ... 28 are roosters ... twenty hens do not lay
eggs ... how many egg-laying hens?" -> 277), each with a worked chain of thought and an integer answer. Operand size
and step count are the difficulty dials: a model of a few million parameters learns single-digit operands in
minutes and two-digit ones hardly at all. The held-out split is chosen by a hash of the problem with the person's
name taken out, so train and held-out never share a problem (not even the same numbers under another name),
whatever the seeds and sizes. Pure Python and pandas.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Callable, Literal

import pandas as pd

from grpo.configs.data import TASK_TEMPLATES, TaskConfig

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Ivy", "Jon", "Kim", "Leo", "Mia", "Ned", "Oli", "Pam"]


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[str, ...]  # one equation per reasoning step, e.g. "7 + 5 = 12"
    answer: int


def _eq(a: int, op: str, b: int) -> tuple[str, int]:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"{a} {op} {b} = {value}", value


# Each template draws its numbers from `rng` (all in [1, hi]), keeps every intermediate result non-negative,
# and returns the question and the equations that solve it.
def _farm(rng: random.Random, hi: int, name: str) -> Problem:
    roosters, idle, hens = rng.randint(1, hi), rng.randint(1, hi), rng.randint(1, hi)
    total = roosters + idle + hens
    s1, h = _eq(total, "-", roosters)
    s2, laying = _eq(h, "-", idle)
    q = f"{name} has {total} chickens; {roosters} are roosters. {idle} hens lay no eggs. How many hens lay eggs?"
    return Problem(q, (s1, s2), laying)


def _shop(rng: random.Random, hi: int, name: str) -> Problem:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    c = rng.randint(1, a + b)
    s1, t = _eq(a, "+", b)
    s2, left = _eq(t, "-", c)
    q = f"{name} has {a} apples, buys {b} and gives away {c}. How many are left?"
    return Problem(q, (s1, s2), left)


def _book(rng: random.Random, hi: int, name: str) -> Problem:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    pages = a + b + rng.randint(1, hi)
    s1, read = _eq(a, "+", b)
    s2, left = _eq(pages, "-", read)
    q = f"A book has {pages} pages. {name} reads {a}, then {b}. How many pages are left?"
    return Problem(q, (s1, s2), left)


def _boxes(rng: random.Random, hi: int, name: str) -> Problem:
    boxes, per, extra = rng.randint(1, max(2, hi // 2)), rng.randint(1, max(2, hi // 2)), rng.randint(1, hi)
    s1, packed = _eq(boxes, "*", per)
    s2, total = _eq(packed, "+", extra)
    q = f"{name} packs {boxes} boxes of {per} pens and has {extra} more. How many pens in all?"
    return Problem(q, (s1, s2), total)


def _bus(rng: random.Random, hi: int, name: str) -> Problem:
    start, on, off = rng.randint(1, hi), rng.randint(1, hi), rng.randint(1, hi)
    off = min(off, start + on)
    s1, mid = _eq(start, "+", on)
    s2, end = _eq(mid, "-", off)
    q = f"{name}'s bus has {start} people. {on} get on, {off} get off. How many are on now?"
    return Problem(q, (s1, s2), end)


def _coins(rng: random.Random, hi: int, name: str) -> Problem:
    a, b, c = rng.randint(1, hi), rng.randint(1, hi), rng.randint(1, hi)
    s1, t = _eq(a, "+", b)
    s2, total = _eq(t, "+", c)
    q = f"{name} finds {a} coins, then {b}, then {c}. How many coins in all?"
    return Problem(q, (s1, s2), total)


TEMPLATES: dict[str, Callable[[random.Random, int, str], Problem]] = {
    "farm": _farm, "shop": _shop, "book": _book, "boxes": _boxes, "bus": _bus, "coins": _coins,
}
assert tuple(TEMPLATES) == TASK_TEMPLATES, "grpo.configs.data.TASK_TEMPLATES names these templates"


def count_out(step: str) -> str:
    """An addition or subtraction counted out one number at a time: "9 + 3 = 12" -> "9 + 3 = 10 11 12".

    The last number is the result. Every count is one step up or down (one fact per number), where recalling
    "9 + 3 = 12" needs one fact per pair of operands. Products and steps that add or take away nothing stay as
    they are.
    """
    a, op, b, _ = re.fullmatch(r"([0-9]+) ([-+*]) ([0-9]+) = ([0-9]+)", step).groups()
    a, b = int(a), int(b)
    if op == "*" or b == 0:
        return step
    sign = 1 if op == "+" else -1
    return f"{a} {op} {b} = " + " ".join(str(a + sign * i) for i in range(1, b + 1))


def format_response(p: Problem, restate_givens: bool = True, counting: bool = False) -> str:
    """The cold-start target: the chain of thought, then the bare integer as the answer.

    The chain of thought first restates the problem's numbers in order ("Given 8, 5, 2."), then solves it one
    equation per step, recalling each result or (`counting`) counting it out. A small model's main failure is the
    arithmetic itself; copying the givens out in order first keeps the numbers a few tokens away.
    """
    givens = f"Given {', '.join(re.findall(r'[0-9]+', p.question))}. " if restate_givens else ""
    steps = [count_out(s) if counting else s for s in p.steps]
    return f"<think>{givens}{' '.join(s + '.' for s in steps)}</think><answer>{p.answer}</answer>"


def is_heldout(question: str, percent: int) -> bool:
    digest = hashlib.sha1(question.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def generate_problems(cfg: TaskConfig, n: int, split: Literal["train", "heldout"], *, seed_offset: int = 0) -> list[Problem]:
    """`n` distinct problems of one split, deterministic in (cfg, split, seed_offset)."""
    unknown = [t for t in cfg.templates if t not in TEMPLATES]
    if unknown:
        raise ValueError(f"unknown task templates {unknown}; known: {sorted(TEMPLATES)}")
    # the held-out draw ignores the seed: every stage that shares the task scores on the same problems
    rng = random.Random(f"{cfg.seed}-train-{seed_offset}" if split == "train" else f"heldout-{seed_offset}")
    want_heldout = split == "heldout"
    seen: set[str] = set()
    out: list[Problem] = []
    for _ in range(200 * n + 1000):  # bounded: a tiny question space must fail loudly, not loop forever
        name = rng.choice(NAMES)
        p = TEMPLATES[rng.choice(cfg.templates)](rng, cfg.max_operand, name)
        problem_key = p.question.replace(name, "_")  # the arithmetic, whoever it is about
        # held-out problems are distinct even without names; training rows may repeat one under other names
        dedupe = problem_key if want_heldout else p.question
        if dedupe in seen or is_heldout(problem_key, cfg.heldout_percent) != want_heldout:
            continue
        seen.add(dedupe)
        out.append(p)
        if len(out) == n:
            return out
    raise ValueError(f"the task's question space holds fewer than {n} distinct {split} problems "
                     f"(max_operand={cfg.max_operand}); raise max_operand or ask for fewer rows")


def counts_out(question: str, share: float, seed: int) -> bool:
    """Whether this row's worked solution counts out its steps: a fixed share, chosen by hash (not by row order)."""
    digest = hashlib.sha1(f"count-{seed}-{question}".encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * 2**32


def sft_rows(problems: list[Problem], task: TaskConfig | None = None) -> pd.DataFrame:
    """Prompt/response rows with worked solutions written the way `task` says (its defaults when None)."""
    task = task or TaskConfig()
    return pd.DataFrame({"prompt": [p.question for p in problems],
                         "response": [format_response(p, task.restate_givens,
                                                      counts_out(p.question, task.counting_share, task.seed))
                                      for p in problems]})


def rl_rows(problems: list[Problem]) -> pd.DataFrame:
    return pd.DataFrame({"prompt": [p.question for p in problems], "answer": [str(p.answer) for p in problems]})


# ----------------------------------------------------------------------------------------------------------------
