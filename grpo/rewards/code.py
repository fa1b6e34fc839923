"""The code reward: R1's compiler feedback. The program in a completion runs against its row's tests, sandboxed.

A row carries its tests in one or both of two formats (mapped from a dataset's columns by `data.columns`):

* `tests`: assert statements (MBPP's `test_list`), with optional `setup` code run before them (MBPP's
  `test_setup_code`);
* `io_tests`: {"inputs": [...], "outputs": [...]}: the program reads an input on stdin and must print the output
  (APPS, CodeContests), compared with trailing whitespace removed from every line and trailing blank lines dropped,
  and it must exit with status 0.

The program is the last fenced code block (```python, ```py or unlabelled) in the answer (`<answer>...</answer>`),
else in the whole completion. The score is the fraction of tests passed, or 1.0 / 0.0 with `all_or_nothing`; a
completion without a program scores 0.0, a row without tests None (the reward does not apply).

**Where the verdict is decided.** Every test runs as its own sandboxed process (`grpo.rewards.sandbox`): the
program, then `setup`, then the test, in one fresh interpreter, so a program that exits, crashes or hangs loses
that test only. Nothing the program can do inside its interpreter decides a verdict, because what comes back is a
*value*, and the comparison happens here, in the trusted caller:

* `assert <expr> == <expected>` with a literal `<expected>` (anything `ast.literal_eval` reads): `<expr>` is
  evaluated inside and sent back as plain data (exact built-in types only: an object whose `__eq__` is always true
  is not plain data and fails); `<expected>` is read here and never sent in, and the two are compared here;
* `assert <a> == <b>` with neither side literal: both are evaluated inside, sent back as plain data and compared
  here; any other `assert <expr>`: its value is sent back and its truth judged here. These run as written inside,
  so a program that rebinds what they call (a `sorted` or `math.isclose` of its own) changes what they compute;
* a test that is not a single assert statement runs as written inside and passes when it completes.

The harness prints the value on a line that starts with a random nonce made for that one run, so the program's own
output ("passed", a fake result) is never mistaken for it. The nonce keeps honest output apart, not hostile code
out: nothing in the program's own interpreter is secret from it. That is why only values come back: a program that
forges its result line can only claim a value, and a claimed value passes only if it equals the expected one,
which is no more than a program returning that value would get. A program that exits before its test, prints a
fake pass, patches the harness or returns an always-equal object scores what it really passed.

Python only; other languages are refused with a clear error (`CODE_LANGUAGES`). Pure Python; must not depend on
torch, Prefect or MLflow.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import functools
import json
import logging
import math
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from grpo.configs.code import CODE_LANGUAGES
from grpo.rewards.outcomes import SANDBOX_ERROR, TIMEOUT_UNDER_LOAD, Ungraded
from grpo.rewards.sandbox import Limits, RunResult, check_sandbox, run_python
from grpo.rewards.text import completion_text
from grpo.texts import ANSWER_TAGS

logger = logging.getLogger(__name__)

_HARNESS = (Path(__file__).with_name("code_harness.py")).read_text()
_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_LABELS = ("", "python", "py", "python3")


class CodeReport(NamedTuple):
    scores: list[float | None | Ungraded]  # what the reward returns
    passed: list[int]  # tests passed per completion
    total: list[int]  # tests per completion (0: the row has none)
    no_program: int  # completions with no code block to run
    reruns: int = 0  # tests killed for wall time and run again alone (`rerun_timed_out`)


# ---------------------------------------------------------------------------------------------------------------
# The tests of a row: checked before training, turned into jobs for the harness

def parse_test(source: str) -> dict:
    """A `tests` entry as a harness job (see grpo.rewards.code_harness); raises SyntaxError for invalid Python."""
    tree = ast.parse(source)
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
        test = tree.body[0].test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            if not _is_literal(right) and _is_literal(left):
                left, right = right, left
            if _is_literal(right):
                return {"kind": "value", "expr": ast.unparse(left), "expected": ast.unparse(right)}
            return {"kind": "pair", "left": ast.unparse(left), "right": ast.unparse(right)}
        return {"kind": "truth", "expr": ast.unparse(test)}
    return {"kind": "run", "code": source}


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def as_list(value: Any) -> list | None:
    """A list cell as a list (Parquet and Arrow hand back numpy arrays); None for a missing cell."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    return list(value) if isinstance(value, (list, tuple)) else value


def as_io_tests(value: Any) -> dict | None:
    """An io_tests cell as {"inputs": [...], "outputs": [...]}: a mapping, or its JSON text (APPS stores it so)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise ValueError(f"expected {{\"inputs\": [...], \"outputs\": [...]}}, got a {type(value).__name__}")
    return {"inputs": as_list(value.get("inputs")), "outputs": as_list(value.get("outputs"))}


def row_tests_problem(tests: Any = None, io_tests: Any = None, setup: Any = None, language: Any = None, *,
                      need_tests: bool = True) -> str | None:
    """What is wrong with one row's tests, for an error message; None when they can be run. A row may have no
    tests only when `need_tests` is off (a dataset whose other rows are checked by their answer)."""
    if language is not None and str(language).strip().lower() not in CODE_LANGUAGES:
        return f"language {language!r} is not supported (supported: {list(CODE_LANGUAGES)})"
    if setup is not None and not (isinstance(setup, float) and math.isnan(setup)):
        if not isinstance(setup, str):
            return f"setup: expected Python code as text, got a {type(setup).__name__}"
        try:
            ast.parse(setup)
        except SyntaxError as e:
            return f"setup is not valid Python ({e.msg}, line {e.lineno}): {setup!r:.80}"
    listed = as_list(tests)
    if listed is not None:
        if not isinstance(listed, list):
            return f"tests: expected a list of assert statements, got {tests!r:.80}"
        for j, test in enumerate(listed):
            if not isinstance(test, str):
                return f"tests[{j}]: expected Python code as text, got {test!r:.80}"
            try:
                parse_test(test)
            except SyntaxError as e:
                return f"tests[{j}] is not valid Python ({e.msg}): {test!r:.80}"
    try:
        io = as_io_tests(io_tests)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        return f"io_tests: {e}"
    if io is not None:
        inputs, outputs = io["inputs"], io["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            return f"io_tests needs lists under \"inputs\" and \"outputs\", got {io_tests!r:.80}"
        if len(inputs) != len(outputs):
            return f"io_tests has {len(inputs)} inputs and {len(outputs)} outputs; each input needs its output"
        bad = [x for x in inputs + outputs if not isinstance(x, str)]
        if bad:
            return f"io_tests inputs and outputs must be text, got {bad[0]!r:.80}"
    if need_tests and not listed and not (io and io["inputs"]):
        return "no tests: the row needs at least one test in tests or io_tests"
    return None


# ---------------------------------------------------------------------------------------------------------------
# The program in a completion

def extract_program(completion: Any, answer_tags: Sequence[str] = ANSWER_TAGS) -> str | None:
    """The last Python (or unlabelled) fenced code block in the answer, else in the whole completion."""
    text = completion_text(completion)
    a_open, a_close = answer_tags
    close = text.rfind(a_close)
    open_ = text.rfind(a_open, 0, close) if close != -1 else -1
    places = ([text[open_ + len(a_open):close]] if open_ != -1 else []) + [text]
    for place in places:
        blocks = [code for label, code in _FENCE.findall(place) if label.lower() in _PYTHON_LABELS]
        if blocks and blocks[-1].strip():
            return blocks[-1]
    return None


# ---------------------------------------------------------------------------------------------------------------
# Judging what came back, here, outside the program's interpreter

def decode(node: Any) -> Any:
    """The harness's encoding (grpo.rewards.code_harness) back into plain Python data; ValueError if malformed."""
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise ValueError("malformed value")
    tag, rest = node[0], node[1:]
    if tag == "N":
        return None
    if tag == "b" and isinstance(rest[0], bool):
        return rest[0]
    if tag == "i":
        return int(rest[0], 16)
    if tag == "f":
        return float(rest[0])
    if tag == "c":
        return complex(float(rest[0]), float(rest[1]))
    if tag == "s" and isinstance(rest[0], str):
        return rest[0]
    if tag == "y":
        return bytes.fromhex(rest[0])
    if tag in ("l", "t", "S", "F"):
        items = [decode(v) for v in rest[0]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    if tag == "d":
        return {decode(k): decode(v) for k, v in rest[0]}
    raise ValueError(f"unknown tag {tag!r}")


def _harness_value(result: RunResult, nonce: str) -> tuple[bool, Any]:
    """(True, value) when the run printed exactly one result line with a value, else (False, None)."""
    if result.killed is not None:
        return False, None
    mark = f"{nonce} ".encode()
    lines = [line[len(mark):] for line in result.stdout.split(b"\n") if line.startswith(mark)]
    if len(lines) != 1:  # none: it never got there; more: the program printed one too
        return False, None
    try:
        reply = json.loads(lines[0])
        if "value" not in reply:  # the test raised, or the value was not plain data
            return False, None
        return True, decode(reply["value"])
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError):
        return False, None


def judge_assert(job: dict, result: RunResult, nonce: str) -> bool:
    ok, value = _harness_value(result, nonce)
    if not ok:
        return False
    try:
        if job["kind"] == "value":
            return bool(value == ast.literal_eval(job["expected"]))
        if job["kind"] == "pair":
            return bool(value[0] == value[1])
        if job["kind"] == "truth":
            return bool(value)
        return True  # "run": it completed
    except (TypeError, ValueError, RecursionError, IndexError):  # comparing plain data rarely raises, but may
        return False


def _normalise_output(text: bytes) -> list[bytes]:
    lines = [line.rstrip() for line in text.replace(b"\r\n", b"\n").split(b"\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def judge_io(expected: str, result: RunResult) -> bool:
    """Exited 0 within its limits and printed the expected output (compared as bytes: no decoding to cheat)."""
    return (result.killed is None and result.exit_code == 0
            and _normalise_output(result.stdout) == _normalise_output(expected.encode()))


# ---------------------------------------------------------------------------------------------------------------
# Running a batch

class _Run(NamedTuple):
    source: str  # what the sandbox runs
    args: tuple[str, ...]
    stdin: bytes


def _runs_for(program: str, tests: list | None, io: dict | None, setup: str | None,
              made: dict[tuple, tuple[_Run, Any]]) -> list[tuple[_Run, Any]]:
    """(run, how to judge it) for each test of a row; `made` hands the same run to the same (program, test)."""
    runs = []
    for test in tests or []:
        key = (program, setup, test)
        if key not in made:
            job = parse_test(test)
            nonce = secrets.token_hex(16)
            inside = {k: v for k, v in job.items() if k != "expected"}  # the expected value never goes in
            payload = json.dumps({**inside, "nonce": nonce, "program": program, "setup": setup or ""})
            made[key] = (_Run(_HARNESS, (payload,), b""), functools.partial(judge_assert, job, nonce=nonce))
        runs.append(made[key])
    if io:
        for stdin, expected in zip(io["inputs"], io["outputs"]):
            runs.append((_Run(program, (), stdin.encode()), functools.partial(judge_io, expected)))
    return runs


def run_pool(runs: Sequence[_Run], limits: Limits, workers: int) -> list[RunResult]:
    """Each run in its own sandbox, `workers` at a time: threads that only wait on their sandbox's process."""
    if not runs:
        return []
    with cf.ThreadPoolExecutor(max_workers=min(workers, len(runs)), thread_name_prefix="code-sandbox") as pool:
        return list(pool.map(lambda r: run_python(r.source, r.args, r.stdin, limits), runs))


def rerun_timed_out(runs: Sequence[_Run], results: list[RunResult], limits: Limits, factor: float,
                    budget_s: float) -> tuple[list[RunResult], int]:
    """The runs killed for wall time, run again one at a time (nothing else of this call running beside them) with
    `factor` times the limit, while `budget_s` allows: a program slowed by a busy machine passes or fails on what
    it does, one that is slow alone still fails. A run whose rerun would pass the budget keeps its kill, marked
    "wall time, not rerun" (ungraded). Returns the results and how many were run again. Cost: each such test
    waits its first limit, then up to `factor` times it alone."""
    import dataclasses
    import time

    out = list(results)
    slow = [k for k, r in enumerate(results) if r.killed == "wall time"]
    longer = dataclasses.replace(limits, wall_time_s=limits.wall_time_s * factor)
    deadline = time.monotonic() + budget_s
    done = 0
    for k in slow:
        if time.monotonic() + longer.wall_time_s > deadline:
            out[k] = out[k]._replace(killed=NOT_RERUN)
            continue
        out[k] = run_python(runs[k].source, runs[k].args, runs[k].stdin, longer)
        done += 1
    if slow:
        logger.info("code reward: %d test(s) killed for wall time, %d run again alone with %gx the limit",
                    len(slow), done, factor)
    return out, done


NOT_RERUN = "wall time, not rerun"  # a RunResult.killed: the test's rerun did not fit the call's budget


def ungraded_by(results: Sequence[RunResult]) -> Ungraded | None:
    """Why a completion's test results cannot grade it: the sandbox failed to start one of its programs, or one
    was killed for wall time and could not be run again alone; None when they can."""
    for r in results:
        if r.sandbox_error is not None:
            return Ungraded(SANDBOX_ERROR, r.sandbox_error[:200])
    for r in results:
        if r.killed == NOT_RERUN:
            return Ungraded(TIMEOUT_UNDER_LOAD, "killed for wall time on a busy sandbox, no time left to rerun it")
    return None


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _column(values: Any, n: int) -> list:
    return list(values) if isinstance(values, (list, tuple)) and len(values) == n else [None] * n


def check_code(completions: Sequence[Any], tests: Sequence[Any] | None = None, io_tests: Sequence[Any] | None = None,
               setup: Sequence[Any] | None = None, *, all_or_nothing: bool = False,
               language: str | Sequence[Any] = "python", limits: Limits = Limits(), workers: int = 0,
               answer_tags: Sequence[str] = ANSWER_TAGS, rerun_factor: float = 2.0,
               rerun_budget_s: float = 120.0) -> CodeReport:
    """`code_reward` plus how many tests each completion passed. `language` is the setting, or a dataset's
    `language` column (one a row; a missing one, None or NaN, means Python). Tests killed for wall time are run
    again alone (`rerun_timed_out`); a completion whose tests could not all be run is ungraded (`ungraded_by`)."""
    languages = [language] if isinstance(language, str) else [v for v in language if isinstance(v, str)]
    unsupported = sorted({str(v) for v in languages if str(v).strip().lower() not in CODE_LANGUAGES})
    if unsupported:
        raise ValueError(f"code reward: language {unsupported[0]!r} is not supported (supported: "
                         f"{list(CODE_LANGUAGES)})")
    check_sandbox(limits)  # refuses, saying why, rather than run anything unsandboxed
    n = len(completions)
    tests_col, io_col, setup_col = _column(tests, n), _column(io_tests, n), _column(setup, n)
    runs: dict[_Run, int] = {}  # deduplicated: a group's G samples often share a program
    made: dict[tuple, tuple[_Run, Any]] = {}
    plans: list[list[tuple[_Run, Any]] | None] = []
    no_program = 0
    for completion, row_tests, row_io, row_setup in zip(completions, tests_col, io_col, setup_col):
        listed, io = as_list(row_tests), as_io_tests(row_io)
        if not listed and not (io and io["inputs"]):
            plans.append(None)  # no tests: the reward does not apply
            continue
        program = extract_program(completion, answer_tags)
        if program is None:
            no_program += 1
            plans.append([])
            continue
        setup_code = row_setup if isinstance(row_setup, str) else None
        plan = _runs_for(program, listed, io, setup_code, made)
        for run, _ in plan:
            runs.setdefault(run, len(runs))
        plans.append(plan)
    ordered = list(runs)
    results, reruns = rerun_timed_out(ordered, run_pool(ordered, limits, workers or available_cores()), limits,
                                      rerun_factor, rerun_budget_s)
    scores: list[float | None | Ungraded] = []
    passed, total = [], []
    for completion_plan, row_tests, row_io in zip(plans, tests_col, io_col):
        if completion_plan is None:
            scores.append(None)
            passed.append(0)
            total.append(0)
            continue
        listed, io = as_list(row_tests) or [], as_io_tests(row_io)
        count = len(listed) + (len(io["inputs"]) if io else 0)
        ok = sum(judge(results[runs[run]]) for run, judge in completion_plan)
        passed.append(ok)
        total.append(count)
        why = ungraded_by([results[runs[run]] for run, _ in completion_plan])
        scores.append(why if why is not None else float(ok == count) if all_or_nothing else ok / count)
    return CodeReport(scores, passed, total, no_program, reruns)


def code_reward(completions: Sequence[Any], tests: Sequence[Any] | None = None,
                io_tests: Sequence[Any] | None = None, setup: Sequence[Any] | None = None, *,
                all_or_nothing: bool = False, language: str | Sequence[Any] = "python", limits: Limits = Limits(),
                workers: int = 0, answer_tags: Sequence[str] = ANSWER_TAGS, rerun_factor: float = 2.0,
                rerun_budget_s: float = 120.0, **_: Any) -> list[float | None | Ungraded]:
    """The fraction of its row's tests the completion's program passes (1.0 / 0.0 with `all_or_nothing`), run in
    the sandbox, `workers` programs at a time (0: one per available core); None for a row without tests;
    ungraded where the sandbox could not run its tests (`check_code`).

    Raises SandboxUnavailable when programs cannot be sandboxed here: it never runs them otherwise.
    """
    return check_code(completions, tests, io_tests, setup, all_or_nothing=all_or_nothing, language=language,
                      limits=limits, workers=workers, answer_tags=answer_tags, rerun_factor=rerun_factor,
                      rerun_budget_s=rerun_budget_s).scores


# the settings of a CodeConfig that are the reward's; the rest are the sandbox's Limits
_REWARD_SETTINGS = ("all_or_nothing", "language", "workers", "rerun_factor", "rerun_budget_s")


def code_limits(settings: Mapping[str, Any] | None = None) -> Limits:
    """The sandbox limits in a recipe's `code` settings (grpo.configs.code.CodeConfig as a dict)."""
    return Limits(**{k: v for k, v in (settings or {}).items() if k not in _REWARD_SETTINGS})


# settings only a recipe gives: a dataset column of the same name (columns arrive as keyword arguments) is ignored,
# so data can never loosen the sandbox's limits or change how a program is scored
_RECIPE_ONLY = ("all_or_nothing", "workers", "limits", "answer_tags", "rerun_factor", "rerun_budget_s")


def make_code_reward(settings: Mapping[str, Any] | None = None) -> Any:
    """`code_reward` with a recipe's `code` settings (grpo.configs.code.CodeConfig as a dict) bound. A row's `language`
    column, where the data has one, takes the place of the recipe's default language."""
    bound = {k: v for k, v in (settings or {}).items() if k in _REWARD_SETTINGS}
    limits = code_limits(settings)

    @functools.wraps(code_reward)
    def reward(completions: Sequence[Any], **columns: Any) -> list[float | None]:
        fixed = {k: v for k, v in bound.items() if not (k == "language" and columns.get("language") is not None)}
        given = {k: v for k, v in columns.items() if k not in _RECIPE_ONLY}
        return code_reward(completions, **given, limits=limits, **fixed)

    return reward
