"""The three outcomes of a grader: a score, "does not apply" (None), and **ungraded**, with its reason.

A reward function, the code sandbox, the judge and the step verifiers answer each completion with a number, with
None where they do not apply to it (a row without a reference), or with `Ungraded(reason)` where they should have
graded it and could not: a check that ran out of time, a sandbox that could not start the program, a judge that
timed out or said nothing readable, a verifier that raised. An ungraded completion is not a wrong one: training
leaves it out of the advantage, rejection sampling neither keeps nor rejects it, evaluation counts it apart.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# the reasons, as they appear in metric names (`reward_ungraded/<function>/<reason>`) and sample tables
TIMEOUT = "timeout"  # a math check that ran past its time limit
TIMEOUT_UNDER_LOAD = "timeout_under_load"  # a program killed for wall time that could not be run again alone
SANDBOX_ERROR = "sandbox_error"  # the sandbox could not start the program (its own failure, not the program's)
JUDGE_TIMEOUT = "judge_timeout"  # the judge did not answer in time
JUDGE_HTTP_ERROR = "judge_http_error"  # the judge's endpoint failed the request
JUDGE_NO_VERDICT = "judge_no_verdict"  # the judge answered without a verdict that could be read
RAISED = "raised"  # the grader raised
POOL_CRASH = "pool_crash"  # the worker process that held the check died (the pool broke), even once retried
MALFORMED = "malformed"  # the grader answered something that is not its contract's (a step verifier's bad steps)
NOT_A_NUMBER = "not_a_number"  # the grader answered NaN, an infinity or something that is not a number
WRONG_LENGTH = "wrong_length"  # the grader answered more or fewer scores than there were completions

REASONS = (TIMEOUT, TIMEOUT_UNDER_LOAD, SANDBOX_ERROR, JUDGE_TIMEOUT, JUDGE_HTTP_ERROR, JUDGE_NO_VERDICT, RAISED,
           POOL_CRASH, MALFORMED, NOT_A_NUMBER, WRONG_LENGTH)


@dataclasses.dataclass(frozen=True)
class Ungraded:
    """A completion its grader could not grade: `reason` one of `REASONS` (a grader of a user's own may name
    another), `detail` what happened, for the logs and sample tables."""

    reason: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


def is_ungraded(value: Any) -> bool:
    return isinstance(value, Ungraded)


def reason_of(value: Any) -> str | None:
    """The reason a grader's answer is ungraded; None for a score or a None."""
    return value.reason if isinstance(value, Ungraded) else None
