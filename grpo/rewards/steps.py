"""Step verifiers for process supervision: where each reasoning step of a completion ends, and whether it holds.

A step verifier is ``fn(completions, **dataset_columns) -> list[Steps]``, one `Steps` per completion (the reward
functions' contract, with steps instead of one score). A completion in which the verifier recognises no step gets
an empty `Steps`; the trainer then falls back to the outcome reward for it and counts it. The answer is not a step
here: grpo.training.process adds it as the last step, rewarded with the outcome reward.

| verifier | the steps | a step holds when |
|---|---|---|
| `arithmetic` | each `a + b = c` equation of the `<think>` block (the synthetic task's; counted ones too: `9 + 3 = 10 11 12.`) | the result is right (a count goes up or down by one to it) and, given the prompts, each operand is one of the problem's numbers or an earlier step's result |
| `gsm8k` | each line of the reasoning with a calculator annotation `<<48/2=24>>` or a plain equation `48 / 2 = 24` | every equation on the line evaluates to its result |

A learned verifier, the process reward model, is in grpo.training.loops.prm (it needs torch).

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import ast
import math
import numbers
import operator
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

from grpo.configs.grading import STEP_VERIFIERS
from grpo.rewards.text import completion_text
from grpo.texts import ANSWER_OPEN, THINK_CLOSE, THINK_OPEN


class Steps(NamedTuple):
    """One completion's reasoning steps, in order."""

    ends: tuple[int, ...] = ()  # exclusive character offset in the completion's text where each step ends
    rewards: tuple[float, ...] = ()  # per step: 1.0 it holds, 0.0 it does not


StepVerifier = Callable[..., list[Steps]]


def reasoning_span(text: str) -> tuple[int, int]:
    """[start, end) of the reasoning in `text`: the `<think>` block, else everything before `<answer>`."""
    start = text.find(THINK_OPEN)
    start = 0 if start < 0 else start + len(THINK_OPEN)
    end = text.find(THINK_CLOSE, start)
    if end < 0:
        end = text.find(ANSWER_OPEN, start)
    return start, len(text) if end < 0 else end


# ----------------------------------------------------------------------------------------------------------------
# The synthetic task: "8 + 5 = 13." or, counted out, "9 + 3 = 10 11 12."

_EQUATION = re.compile(r"([0-9]+) ?([-+*]) ?([0-9]+) ?= ?([0-9]+(?: [0-9]+)*)\.?")
_NUMBER = re.compile(r"[0-9]+")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def equation_holds(a: int, op: str, b: int, results: Sequence[int]) -> bool:
    """Whether `a op b = results` is right: one number, the value; or a count that steps by one to it.

    >>> equation_holds(9, "+", 3, [10, 11, 12]), equation_holds(9, "+", 3, [10, 12]), equation_holds(2, "*", 3, [6])
    (True, False, True)
    """
    value = _OPS[op](a, b)
    if len(results) == 1:
        return results[0] == value
    if op == "*":
        return False
    sign = 1 if op == "+" else -1
    return list(results) == [a + sign * i for i in range(1, b + 1)]


def _prompt_text(prompt: Any) -> str:
    """A prompt cell as text: a string, or every message's content of a chat."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return "\n".join(completion_text(m) for m in prompt)
    return completion_text(prompt)


def arithmetic_steps(completions: Sequence[Any], prompts: Sequence[Any] | None = None,
                     prompt: Sequence[Any] | None = None, **_: Any) -> list[Steps]:
    """Each `a op b = c` equation of the reasoning is a step; it holds when its arithmetic is right and (when the
    prompts are given) its operands are the problem's numbers or results of earlier steps (a number copied wrong
    from the question is the tiny model's commonest error). A step ends after its last number (and its period).
    """
    prompts = prompts if prompts is not None else prompt
    out = []
    for i, completion in enumerate(completions):
        text = completion_text(completion)
        start, end = reasoning_span(text)
        known = None if prompts is None else {int(n) for n in _NUMBER.findall(_prompt_text(prompts[i]))}
        ends, rewards = [], []
        for m in _EQUATION.finditer(text, start, end):
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            results = [int(n) for n in m.group(4).split()]
            holds = equation_holds(a, op, b, results)
            if known is not None:
                holds = holds and a in known and b in known
                known.add(results[-1])  # what the step claims is what later steps may build on
            ends.append(m.end())
            rewards.append(1.0 if holds else 0.0)
        out.append(Steps(tuple(ends), tuple(rewards)))
    return out


# ----------------------------------------------------------------------------------------------------------------
# GSM8K-style solutions: "Natalia sold 48/2 = <<48/2=24>>24 clips in May." one step a line

_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>=]*)>>")
_NUM = r"\$?[0-9][0-9,]*(?:\.[0-9]+)?%?"
_OP = r"[-+*/×÷x]"
_PLAIN = re.compile(rf"({_NUM}(?:\s*{_OP}\s*{_NUM})+)\s*=\s*({_NUM})")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _number(text: str) -> Fraction:
    text = text.strip().replace(",", "").replace("$", "")
    if text.endswith("%"):
        return Fraction(text[:-1]) / 100
    return Fraction(text)


def evaluate_expression(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (numbers, + - * / x × ÷, %, $, commas, parentheses).

    Raises ValueError for anything else (names, calls, powers), so no text is ever executed.
    >>> evaluate_expression("$1,200 x 5% + (3 - 1)/4")
    Fraction(121, 2)
    """
    text = expression.replace("×", "*").replace("÷", "/").replace("x", "*").replace(",", "").replace("$", "")
    text = re.sub(r"([0-9.]+)%", r"(\1/100)", text)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    return value(tree.body)


def result_matches(value: Fraction, written: str) -> bool:
    """Whether a written result states `value`: exactly, or within one unit of its last digit when the value is
    not a whole number (10/3 written 3.33 or 3; GSM8K rounds and floors as the question needs).

    >>> result_matches(Fraction(10, 3), "3.33"), result_matches(Fraction(7), "7.0"), result_matches(Fraction(7), "8")
    (True, True, False)
    """
    try:
        claimed = _number(written)
    except (ValueError, ZeroDivisionError):
        return False
    if value.denominator == 1 or claimed == value:
        return claimed == value
    digits = written.strip().rstrip("%").split(".")
    decimals = len(digits[1]) if len(digits) == 2 else 0
    return abs(value - claimed) < Fraction(1, 10**decimals)


def _holds(expression: str, written: str) -> bool:
    try:
        return result_matches(evaluate_expression(expression), written)
    except (ValueError, ZeroDivisionError):
        return False


def line_equations(line: str) -> list[bool]:
    """Whether each equation of a line holds: its calculator annotations, then the plain equations around them."""
    verdicts = [_holds(e, r) for e, r in _ANNOTATION.findall(line)]
    # "48/2 = <<48/2=24>>24": with the annotation taken out the plain equation reads "48/2 = 24"
    plain = _ANNOTATION.sub("", line)
    verdicts += [_holds(e, r) for e, r in _PLAIN.findall(plain)]
    return verdicts


def gsm8k_steps(completions: Sequence[Any], **_: Any) -> list[Steps]:
    """Each line of the reasoning that holds an equation is a step, ending at the line's last character; it holds
    when every equation on it does. Lines without an equation belong to the next step."""
    out = []
    for completion in completions:
        text = completion_text(completion)
        start, end = reasoning_span(text)
        ends, rewards = [], []
        pos = start
        for line in text[start:end].split("\n"):
            verdicts = line_equations(line)
            if verdicts:
                ends.append(pos + len(line.rstrip()))
                rewards.append(1.0 if all(verdicts) else 0.0)
            pos += len(line) + 1
        out.append(Steps(tuple(ends), tuple(rewards)))
    return out


STEP_VERIFIER_FUNCTIONS: dict[str, StepVerifier] = {"arithmetic": arithmetic_steps, "gsm8k": gsm8k_steps}
assert set(STEP_VERIFIER_FUNCTIONS) | {"prm"} == set(STEP_VERIFIERS), "grpo.configs.grading.STEP_VERIFIERS names these"


def step_problem(s: Any, i: int = 0) -> str | None:
    """What is wrong with a verifier's answer `s` for completion `i`, or None where it is well-formed Steps: ends
    and rewards of one length, the ends whole offsets in order, the rewards finite numbers.

    >>> step_problem(Steps((5, 3), (1.0, 1.0))), step_problem(Steps((5,), (1.0,)))
    ("completion 0's step ends [5, 3] are not in order", None)
    """
    ends, rewards = getattr(s, "ends", None), getattr(s, "rewards", None)
    if not isinstance(ends, Sequence) or not isinstance(rewards, Sequence):
        return f"completion {i}'s answer {s!r:.80} is not Steps"
    if len(ends) != len(rewards):
        return f"completion {i} has {len(ends)} step ends and {len(rewards)} rewards"
    if not all(isinstance(e, numbers.Integral) and not isinstance(e, bool) and e >= 0 for e in ends):
        return f"completion {i}'s step ends {list(ends)!r:.80} are not character offsets"
    if any(b < a for a, b in zip(ends, ends[1:])):
        return f"completion {i}'s step ends {list(ends)} are not in order"
    if not all(isinstance(r, numbers.Real) and not isinstance(r, bool) and math.isfinite(r) for r in rewards):
        return f"completion {i}'s step rewards {list(rewards)!r:.80} are not all finite numbers"
    return None


def check_steps(steps: Sequence[Steps], n: int, name: str = "step verifier") -> list[Steps]:
    """A verifier's output as `n` well-formed Steps, or a ValueError that says what is wrong."""
    steps = list(steps)
    if len(steps) != n:
        raise ValueError(f"{name} returned {len(steps)} step lists for {n} completions")
    for i, s in enumerate(steps):
        problem = step_problem(s, i)
        if problem is not None:
            raise ValueError(f"{name}: {problem}")
    return steps
