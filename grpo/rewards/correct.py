"""Whether a completion is right by its row's own check: the pass/fail that evaluation and rejection sampling ask.

A row with tests (`tests` or `io_tests`, see `grpo.rewards.code`) is checked by running them in the sandbox, and its
completion is right when its program passes every one (pass@1 as code benchmarks count it, whatever the recipe's
`code.all_or_nothing` says about the training reward). Any other row is checked by its reference `answer`, as the
accuracy reward does. One function decides for both, so `eval/accuracy` and the samples rejection sampling keeps
mean the same thing on code as on math, and a held-out set or a prompt table may mix the two kinds.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from grpo.rewards.accuracy import accuracy_reward
from grpo.rewards.code import as_io_tests, as_list, check_code, code_limits
from grpo.rewards.outcomes import Ungraded

CHECK_COLUMNS = ("answer", "tests", "io_tests", "setup", "language")  # the row columns `check_rows` reads


class RowCheck(NamedTuple):
    correct: list[bool | None]  # per completion; None: its row has no tests and no readable reference, or ungraded
    by_tests: list[bool]  # its row was checked by running tests (else by the reference answer)
    passed: list[int]  # tests its program passed (0 for rows checked by answer)
    total: list[int]  # tests in its row (0 for rows checked by answer)
    # per completion: why the check could not say (`grpo.rewards.outcomes`: a timeout, a sandbox failure); None
    # where it said, or does not apply. Neither right nor wrong: counted apart
    ungraded: list[str | None] | None = None


def has_tests(tests: Any = None, io_tests: Any = None) -> bool:
    """Whether a row carries at least one test to run (a cell may be None, NaN, a list or a numpy array)."""
    listed, io = as_list(tests), as_io_tests(io_tests)
    return bool(listed) or bool(io and io["inputs"])


def _cells(column: Sequence[Any] | None, n: int) -> list:
    return list(column) if column is not None else [None] * n


def check_rows(completions: Sequence[Any], answer: Sequence[Any] | None = None, tests: Sequence[Any] | None = None,
               io_tests: Sequence[Any] | None = None, setup: Sequence[Any] | None = None,
               language: Sequence[Any] | None = None, *, code: Mapping[str, Any] | None = None) -> RowCheck:
    """Each completion against its row (columns aligned with `completions`, one value per completion): all its
    tests passing where the row has tests, else its answer matching the reference. `code` is a recipe's code
    settings (grpo.configs.code.CodeConfig as a dict): the sandbox's limits, workers and default language.

    Raises SandboxUnavailable when some row has tests and programs cannot be sandboxed here.
    """
    n = len(completions)
    answers, tests, io_tests = _cells(answer, n), _cells(tests, n), _cells(io_tests, n)
    setup, language = _cells(setup, n), _cells(language, n)
    by_tests = [has_tests(t, io) for t, io in zip(tests, io_tests)]
    correct: list[bool | None] = [None] * n
    ungraded: list[str | None] = [None] * n
    passed, total = [0] * n, [0] * n

    coded = [i for i in range(n) if by_tests[i]]
    if coded:
        settings = dict(code or {})
        default_language = settings.get("language", "python")
        report = check_code([completions[i] for i in coded], [tests[i] for i in coded],
                            [io_tests[i] for i in coded], [setup[i] for i in coded],
                            language=[language[i] if isinstance(language[i], str) else default_language
                                      for i in coded],
                            limits=code_limits(settings), workers=settings.get("workers", 0),
                            **{k: settings[k] for k in ("rerun_factor", "rerun_budget_s") if k in settings})
        for i, ok, count, score in zip(coded, report.passed, report.total, report.scores):
            passed[i], total[i] = ok, count
            if isinstance(score, Ungraded):
                ungraded[i] = score.reason
            else:
                correct[i] = ok == count

    referenced = [i for i in range(n) if not by_tests[i] and _reference(answers[i]) is not None]
    if referenced:
        scores = accuracy_reward([completions[i] for i in referenced], [_reference(answers[i]) for i in referenced])
        for i, s in zip(referenced, scores):
            if isinstance(s, Ungraded):
                ungraded[i] = s.reason
            else:
                correct[i] = None if s is None else s == 1.0  # None: a reference the check cannot read
    return RowCheck(correct, by_tests, passed, total, ungraded)


def _reference(value: Any) -> str | None:
    """An `answer` cell as reference text; None when missing, NaN or blank."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    text = str(value).strip()
    return text or None
