"""The accuracy reward: the extracted answer against the reference, fast paths first, math-verify for the rest.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from grpo.rewards.answers import extract_answer, extract_boxed
from grpo.rewards.forms import rewrite, word, word_verdict
from grpo.rewards.math_fast import fast_verdict, parse_plain
from grpo.rewards.math_latex import latex_value
# the module by its own name, not through the package (whose __init__ imports this one); qualified where its
# reasons share their names with the pool's codes (TIMEOUT, RAISED)
import grpo.rewards.outcomes as outcomes
from grpo.rewards.outcomes import Ungraded
from grpo.rewards.math_verify_pool import (
    BAD_REFERENCE,
    CRASHED,
    EQUAL,
    RAISED,
    TIMEOUT,
    symbolic_verdicts,
)
from grpo.rewards.text import completion_text
from grpo.texts import ANSWER_TAGS

logger = logging.getLogger(__name__)



RETRY_FACTOR = 5.0  # a check past its time limit is made again, alone, with this many times the limit


class AccuracyReport(NamedTuple):
    scores: list[float | None | Ungraded]
    fast_path: int  # decided without math-verify (plain numbers, LaTeX shortcut, no answer)
    symbolic: int  # completions sent to math-verify
    timeouts: int  # completions whose check timed out (ungraded: TIMEOUT)
    failed: int = 0  # completions whose check raised or lost its worker process (ungraded: RAISED, POOL_CRASH)


def _reference_text(reference: Any) -> str | None:
    """The reference answer as a string: GSM8K's "#### 42" tail, or a \\boxed{} content.

    Pass references as strings: a float's repr ("1e-07") is not an answer format.
    """
    if reference is None or (isinstance(reference, float) and math.isnan(reference)):  # NaN: a table's empty cell
        return None
    if isinstance(reference, bool) or not isinstance(reference, (str, numbers.Number)):
        return None
    s = str(reference)
    if "####" in s:
        s = s.rsplit("####", 1)[1]
    boxed = extract_boxed(s) if "\\boxed" in s else None
    s = rewrite(_without_currency((boxed if boxed is not None else s).strip()))
    return s or None


def _prediction_text(completion: Any, answer_tags: Sequence[str]) -> str | None:
    answer = extract_answer(completion_text(completion), answer_tags)
    if answer and "\\boxed" in answer:  # <answer>… \boxed{x} …</answer>
        answer = extract_boxed(answer) or answer
    return rewrite(_without_currency(answer)) if answer else None


# a dollar sign before an amount: "\$12.50" (LaTeX's escaped dollar), or "$12.50" with no closing "$" (not math mode)
_CURRENCY = re.compile(r"^(?:\\\$|\$(?=[^$]*$))\s*(?=[-+]?[\d.,])")


def _without_currency(text: str) -> str:
    """An amount without its dollar sign, which math-verify cannot read ("\\$272.62" is 272.62); anything else as is.
    Found by the audit set (grpo/rewards/audit.py): every currency pair was missed before."""
    return _CURRENCY.sub("", text.strip())


def symbolic_outcome(code: int, timeout_s: float) -> float | None | Ungraded:
    """A completion's score from its symbolic check's verdict code: 1.0 or 0.0; None for a reference math-verify
    cannot parse; ungraded, with what happened, for a check that gave no verdict (past its time limit and the
    retry's, raised, or its worker process died).

    >>> symbolic_outcome(CRASHED, 2.0).reason, symbolic_outcome(EQUAL, 2.0)
    ('pool_crash', 1.0)
    """
    if code == TIMEOUT:  # not a wrong answer: the check could not say (a busy machine, a huge expression)
        return Ungraded(outcomes.TIMEOUT, f"math-verify ran past {timeout_s:g} s, then {timeout_s * RETRY_FACTOR:g} s")
    if code == RAISED:
        return Ungraded(outcomes.RAISED, "math-verify raised")
    if code == CRASHED:
        return Ungraded(outcomes.POOL_CRASH, "the math-verify worker process died, and again in a fresh pool")
    return None if code == BAD_REFERENCE else float(code == EQUAL)


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

    scores: list[float | None | Ungraded] = [None] * len(completions)
    pending: dict[tuple[str, str | None], list[int]] = {}  # deduplicated: G samples share answers
    fast = 0
    for i, (completion, reference) in enumerate(zip(completions, answer)):
        gold = _reference_text(reference)
        if gold is None:
            continue  # no reference: not scorable
        pred = _prediction_text(completion, answer_tags)
        if pred is None:
            if parse_plain(gold) is not None or latex_value(gold) is not None or word(gold):  # surely gradable
                scores[i] = 0.0
                fast += 1
            else:  # 0.0 unless the reference itself turns out unparseable
                pending.setdefault((gold, None), []).append(i)
            continue
        verdict = word_verdict(gold, pred)  # a one-word reference ("Monday", "yes"): compared as a word
        if verdict is None:
            verdict = fast_verdict(gold, pred)
        if verdict is not None:
            scores[i] = float(verdict)
            fast += 1
        else:
            pending.setdefault((gold, pred), []).append(i)

    pairs = list(pending)
    codes = dict(zip(pairs, symbolic_verdicts(pairs, timeout_s, symbolic_backend)))
    slow = [pair for pair, code in codes.items() if code == TIMEOUT]
    if slow:  # once more, by themselves, with RETRY_FACTOR times the time: a busy machine's slowness is not theirs
        codes.update(zip(slow, symbolic_verdicts(slow, timeout_s * RETRY_FACTOR, symbolic_backend)))
    timeouts = failed = 0
    for pair, code in codes.items():
        for i in pending[pair]:
            scores[i] = symbolic_outcome(code, timeout_s)
            timeouts += code == TIMEOUT
            failed += code in (RAISED, CRASHED)
    return AccuracyReport(scores, fast, sum(map(len, pending.values())), timeouts, failed)


def accuracy_reward(
    completions: Sequence[Any],
    answer: Sequence[Any],
    *,
    timeout_s: float = 2.0,
    answer_tags: Sequence[str] = ANSWER_TAGS,
    symbolic_backend: str = "thread",
    **_: Any,
) -> list[float | None | Ungraded]:
    """1.0 if the extracted answer equals the reference under math-verify, else 0.0.

    The answer is the last ``<answer>`` block, else the last ``\\boxed{}`` (a box
    inside the answer block is unwrapped). Decided without math-verify, with
    its verdict: plain numbers on both sides (exact comparison, or its own
    6-decimal rounding rule when a decimal is close), and simple LaTeX answers
    that are identical, equal in exact value, or provably different in value
    (see ``fast_verdict``). Everything else goes through ``math_verify.parse`` /
    ``verify`` in a daemon thread (``symbolic_backend="thread"``, the default) or
    a worker process (``"process"``: stuck checks can be killed and checks spread
    over cores, but the calling script needs an ``if __name__ == "__main__":``
    guard since workers are started with "spawn"), at most ``timeout_s`` per
    parse+verify; a check past it is made once more, apart from the others, with
    ``RETRY_FACTOR`` (5) times the limit, and one still past that is ungraded
    (``Ungraded("timeout")``, logged), not wrong, as is a check that raised (``"raised"``) or whose worker
    process died (``"pool_crash"``); a reference that math-verify cannot parse scores None.
    Safe to call from any thread.
    """
    report = check_accuracy(
        completions, answer, timeout_s=timeout_s, answer_tags=answer_tags, symbolic_backend=symbolic_backend
    )
    if report.timeouts:
        logger.warning("accuracy_reward: %d of %d checks timed out (ungraded)", report.timeouts, len(completions))
    if report.failed:
        logger.warning("accuracy_reward: %d of %d checks raised or lost their worker (ungraded)", report.failed,
                       len(completions))
    return report.scores
