"""The code reward: which program it takes from a completion, how it reads tests, and that it scores right programs
right and wrong ones wrong, in both test formats; the `code` settings, the data roles, and bad input caught before
training. The hostile programs are in tests/grpo/rewards/test_sandbox.py.

Tests that run programs need bubblewrap (`apt-get install -y bubblewrap`): skipped without it, failed in CI.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from grpo.configs.code import CodeConfig
from grpo.configs.data import DataConfig
from grpo.configs.training import GRPOConfig
from grpo.data.tables import DataError, load_rl_data
from grpo.rewards import REWARD_FUNCTIONS, check_code, check_reward_columns, extract_program, score_completions
from grpo.rewards.code import code_limits, make_code_reward, parse_test
from grpo.rewards.outcomes import reason_of
from grpo.rewards.sandbox import Limits, SandboxUnavailable



def fenced(code: str, label: str = "python") -> str:
    return f"```{label}\n{code}\n```"


def answer(code: str) -> str:
    return f"<think>I add them.</think><answer>{fenced(code)}</answer>"


ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
RIGHT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a * b"  # right for (2, 2) only: 1 of 3


def test_the_program_is_the_last_python_block_of_the_answer_else_of_the_completion():
    assert extract_program(answer("x = 2")) == "x = 2\n"
    both = f"{fenced('x = 1')} <think>t</think><answer>{fenced('x = 2')} then {fenced('x = 3', 'py')}</answer>"
    assert extract_program(both) == "x = 3\n"
    assert extract_program(f"<answer>42</answer> {fenced('x = 1', '')}") == "x = 1\n"  # none in the answer
    assert extract_program(f"<answer>{fenced('int main() {}', 'cpp')}</answer>") is None  # not Python
    assert extract_program("def add(a, b): return a + b") is None  # not fenced
    assert extract_program([{"role": "assistant", "content": answer("y = 1")}]) == "y = 1\n"


def test_asserts_are_read_into_values_compared_outside():
    assert parse_test("assert add(1, 2) == 3") == {"kind": "value", "expr": "add(1, 2)", "expected": "3"}
    assert parse_test("assert [1, 2] == f(x)") == {"kind": "value", "expr": "f(x)", "expected": "[1, 2]"}
    assert parse_test("assert f(x) == sorted(y)") == {"kind": "pair", "left": "f(x)", "right": "sorted(y)"}
    assert parse_test("assert math.isclose(f(1), 2.5)") == {"kind": "truth", "expr": "math.isclose(f(1), 2.5)"}
    assert parse_test("x = f(1)\nassert x") == {"kind": "run", "code": "x = f(1)\nassert x"}
    with pytest.raises(SyntaxError):
        parse_test("assert f(1) ==")


def test_right_and_wrong_programs_score_the_tests_they_pass(bwrap):
    completions = [answer(RIGHT), answer(WRONG), "I cannot write code", answer("def add(a, b): return a + b\n"
                                                                             "raise SystemExit(0)")]
    report = check_code(completions, tests=[ADD_TESTS] * 4)
    assert report.passed == [3, 1, 0, 0] and report.total == [3, 3, 3, 3] and report.no_program == 1
    assert report.scores == [1.0, pytest.approx(1 / 3), 0.0, 0.0]
    assert check_code(completions[:2], tests=[ADD_TESTS] * 2, all_or_nothing=True).scores == [1.0, 0.0]


def test_setup_pair_truth_and_statement_tests(bwrap):
    program = "def squares(n):\n    return [i * i for i in range(n)]"
    tests = ["assert squares(3) == expected", "assert sorted(squares(3), reverse=True) == [4, 1, 0]",
             "assert len(squares(5)) > 4", "total = sum(squares(4))\nassert total == 14",
             "assert squares(2) == (0, 1)"]  # a list is not a tuple, outside as inside: fails
    report = check_code([answer(program)], tests=[tests], setup=["expected = [0, 1, 4]"])
    assert report.passed == [4] and report.total == [5]


def test_io_tests_compare_stdout_with_trailing_whitespace_normalised(bwrap):
    io = {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3", "7  \n\n", "0\n"]}
    right = "a, b = map(int, input().split())\nprint(a + b, ' ')"
    crashes_after = "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)"
    wrong = "print(input())"
    report = check_code([answer(right), answer(crashes_after), answer(wrong)], io_tests=[io] * 3)
    assert report.passed == [3, 0, 0]  # a run must also exit with status 0
    # both formats on one row (io_tests as JSON text, as APPS stores it): the asserts run the program as a module
    # named "solution", so its main block runs only for the io tests
    both = ("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n"
            "    print(add(*map(int, input().split())))")
    mixed = check_code([answer(both)], tests=[["assert add(1, 1) == 2"]], io_tests=[json.dumps(io)])
    assert mixed.passed == [4] and mixed.total == [4]


def test_rows_without_tests_do_not_apply_and_other_languages_are_refused(bwrap):
    assert check_code([answer(RIGHT), answer(RIGHT)], tests=[ADD_TESTS, None]).scores == [1.0, None]
    with pytest.raises(ValueError, match="language 'cpp' is not supported"):
        check_code([answer(RIGHT)], tests=[ADD_TESTS], language="cpp")
    # a dataset's language column reaches the reward as a keyword list, like any column
    rows = {"tests": [ADD_TESTS] * 2, "language": ["Python", None]}
    assert score_completions([answer(RIGHT)] * 2, {"code": 1.0}, rows).per_function["code"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="language 'cpp' is not supported"):
        check_code([answer(RIGHT)], tests=[ADD_TESTS], language=["cpp"])


def test_the_registry_weights_code_like_any_reward(bwrap):
    scores = score_completions([answer(RIGHT), answer(WRONG)], {"code": 2.0, "format": 0.5}, {"tests": [ADD_TESTS] * 2})
    assert scores.per_function["code"] == [1.0, pytest.approx(1 / 3)]
    assert scores.total == [pytest.approx(2.5), pytest.approx(2 / 3 + 0.5)]
    assert REWARD_FUNCTIONS["code"].__name__ == "code_reward"


def test_settings_bind_limits_and_scoring(bwrap):
    cfg = GRPOConfig(rewards={"code": 1.0}, code=CodeConfig(all_or_nothing=True, wall_time_s=1.0, rerun_factor=1.5))
    assert code_limits(CodeConfig().model_dump()) == Limits()  # the recipe's defaults are the sandbox's
    reward = make_code_reward(cfg.grading.code.model_dump())
    assert reward([answer(WRONG), answer(RIGHT)], tests=[ADD_TESTS] * 2) == [0.0, 1.0]
    slow = "import time\ntime.sleep(2)\n" + RIGHT  # past the recipe's 1 s of wall time, and its rerun's 1.5 s
    assert reward([answer(slow)], tests=[ADD_TESTS]) == [0.0]
    # a dataset's columns named like settings change nothing: only the recipe sets how programs are run and scored
    columns = {"all_or_nothing": [False] * 3, "workers": [64] * 3, "limits": [None] * 3, "answer_tags": [None] * 3,
               "rerun_factor": [100.0] * 3, "rerun_budget_s": [1e9] * 3}
    assert reward([answer(WRONG), answer(RIGHT), answer(slow)], tests=[ADD_TESTS] * 3, **columns) == [0.0, 1.0, 0.0]
    with pytest.raises(ValidationError, match="python"):
        CodeConfig(language="cpp")
    with pytest.raises(ValidationError, match="supervision .process. cannot be used with the code reward"):
        GRPOConfig(rewards={"code": 1.0}, supervision="process", step_verifier="gsm8k")


def test_without_bwrap_the_reward_refuses(monkeypatch, tmp_path):
    from grpo.rewards import sandbox

    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bubblewrap"):  # raised through the registry, not swallowed
            score_completions([answer(RIGHT)], {"code": 1.0}, {"tests": [ADD_TESTS]})
    finally:
        sandbox._probe.cache_clear()


# ----------------------------------------------------------------------------------------------------------------
# Data: MBPP's columns through data.columns, and bad rows named before training

MBPP_ROW = {"text": "Write a function add(a, b).", "code": RIGHT, "task_id": 1, "test_setup_code": "",
            "test_list": ADD_TESTS}
MBPP = {"prompt": "text", "tests": "test_list", "setup": "test_setup_code"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_mbpp_rows_load_by_naming_their_columns_and_need_no_answer(tmp_path):
    path = write_jsonl(tmp_path / "mbpp.jsonl", [MBPP_ROW, {**MBPP_ROW, "test_setup_code": "import math"}])
    train, _ = load_rl_data(DataConfig(source=path, columns=MBPP, num_heldout=0))
    assert "answer" not in train.columns
    assert train["tests"].tolist() == [ADD_TESTS, ADD_TESTS] and train["setup"].tolist() == [None, "import math"]
    check_reward_columns({"code": 1.0, "format": 0.5}, train.columns)
    with pytest.raises(ValueError, match="the accuracy reward reads the 'answer' column"):
        check_reward_columns({"accuracy": 1.0}, train.columns)
    io_path = write_jsonl(tmp_path / "apps.jsonl", [{"question": "Add.", "input_output": json.dumps(
        {"inputs": ["1 2\n"], "outputs": ["3\n"]})}])
    rows, _ = load_rl_data(DataConfig(source=io_path, columns={"prompt": "question", "io_tests": "input_output"},
                                      num_heldout=0))
    assert rows["io_tests"].tolist() == [{"inputs": ["1 2\n"], "outputs": ["3\n"]}]


@pytest.mark.parametrize("row, columns, message", [
    ({**MBPP_ROW, "test_list": ["assert add(1, 2) =="]}, MBPP, "row 1: tests\\[0\\] is not valid Python"),
    ({"text": "t", "io": {"inputs": ["1", "2"], "outputs": ["1"]}}, {"prompt": "text", "io_tests": "io"},
     "row 1: io_tests has 2 inputs and 1 outputs"),
    ({**MBPP_ROW, "language": "cpp"}, MBPP, "row 1: language 'cpp' is not supported"),
    ({**MBPP_ROW, "test_list": []}, MBPP, "row 1: no tests"),
    ({**MBPP_ROW, "test_setup_code": "import"}, MBPP, "row 1: setup is not valid Python"),
])
def test_bad_code_rows_are_named_before_training(tmp_path, row, columns, message):
    good = {k: v for k, v in MBPP_ROW.items()} if "io" not in row else {"text": "t", "io": {"inputs": ["1"],
                                                                                            "outputs": ["1"]}}
    if "language" in row:
        good["language"] = "python"
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row])
    with pytest.raises(DataError, match=f"bad.jsonl: {message}"):
        load_rl_data(DataConfig(source=path, columns=columns, num_heldout=0))


def test_no_tests_column_for_the_code_reward_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    train, _ = load_rl_data(DataConfig(source=path, num_heldout=0))
    with pytest.raises(ValueError, match="the code reward reads the 'tests' or 'io_tests' column"):
        check_reward_columns({"code": 1.0}, train.columns, "math.jsonl")
    with pytest.raises(DataError, match="missing column\\(s\\) \\['test_list'\\]"):
        load_rl_data(DataConfig(source=path, columns={"tests": "test_list"}, num_heldout=0))


# ----------------------------------------------------------------------------------------------------------------
# Tests the sandbox could not run: a second run alone, and "ungraded" where it cannot say


def test_a_program_killed_for_wall_time_beside_others_runs_again_alone_before_it_fails(bwrap):
    """Four programs that each sleep 1.5 s past a 1 s limit, side by side: all killed; each then runs again alone
    with twice the limit, where it finishes and passes. One that sleeps past the longer limit too fails (0), and a
    rerun that does not fit the call's budget leaves its completion ungraded, neither passed nor failed."""
    slow = "import time\ntime.sleep(1.5)\n" + RIGHT
    forever = "import time\ntime.sleep(60)\n" + RIGHT
    limits = Limits(wall_time_s=1.0)
    report = check_code([answer(slow)] * 2 + [answer(forever)], tests=[ADD_TESTS[:1], ADD_TESTS[1:2], ADD_TESTS[:1]],
                        limits=limits, workers=3)
    assert report.scores == [1.0, 1.0, 0.0] and report.reruns == 3
    no_time = check_code([answer(slow)], tests=[ADD_TESTS[:1]], limits=limits, rerun_budget_s=0.5)
    assert [reason_of(s) for s in no_time.scores] == ["timeout_under_load"] and no_time.reruns == 0


SANDBOX_STARVED = """
import resource, sys
sys.path[:0] = {paths!r}
from grpo.rewards.code import check_code
from grpo.rewards.sandbox import check_sandbox

check_sandbox()  # the sandbox works here; then this process may start no more processes as the sandbox's user
resource.setrlimit(resource.RLIMIT_NPROC, (1, 1))
report = check_code({completions!r}, tests={tests!r})
print(repr([str(s) for s in report.scores]))
"""


def test_a_sandbox_that_cannot_start_a_program_leaves_it_ungraded_not_failed(bwrap, tmp_path):
    """A real failure of the sandbox itself (no process left to the sandbox's user: bubblewrap cannot start, or
    cannot create its namespaces) grades nothing: the completion is ungraded with bubblewrap's own words, never 0."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    script = tmp_path / "starved.py"
    script.write_text(SANDBOX_STARVED.format(paths=[str(root)], completions=[answer(RIGHT)], tests=[ADD_TESTS]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    [score] = eval(out.stdout.strip().splitlines()[-1])
    # bubblewrap's words when its namespaces fail, or the kernel's when the sandbox's user may not start it at all
    assert score.startswith("sandbox_error: ") and "Resource temporarily unavailable" in score, score
