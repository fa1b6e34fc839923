"""`r1 audit-rewards`: the checkers' counts on rows whose verdicts are worked out by hand, the shipped set split by
when its pairs were added against the rule, a bad row told before grading, and rule + appeal through a real HTTP
judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli.r1 import main
from grpo.rewards.audit import AFTER_TUNING, BEFORE_TUNING, SPLIT_NOTE, TUNED_FOR, audit_pairs
from judges import scripted_judge

# (reference, answer, equal, added); the rule's and math-verify's verdicts, and why
ROWS = [
    ("0.5", "1/2", True, "early"),  # rule TP, math-verify TP: one value as a fraction, both read it
    ("0.5", "one half", True, "early"),  # rule FN, math-verify FN: a fraction in words, neither reads it
    ("7", "8", False, "early"),  # TN, TN
    ("\\$12.50", "12.5", True, "early"),  # rule TP (drops the dollar sign), math-verify FN (cannot read "\$12.50")
    ("[-7, -3]", "(-7, -3)", False, "late"),  # rule TN, math-verify FP (its interval compare ignores the brackets)
    ("", "5", True, "late"),  # rule FN, ungraded (no reference to read); math-verify FN (parses nothing)
    ("5", "five", True, "late"),  # rule TP (reads number words), math-verify FN
    ("3 2/3", "4 2/3", False, "late"),  # rule TN, math-verify FP (reads the trailing 2/3 of each)
]


def _file(tmp_path: Path, rows=ROWS) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"reference": r, "answer": a, "equal": e, "added": added}) + "\n"
                            for r, a, e, added in rows))
    return str(path)


def _figures(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _counts(f: dict) -> tuple:
    return f["tp"], f["fp"], f["fn"], f["tn"], f["ungraded"]


def test_the_rule_and_math_verify_on_rows_worked_out_by_hand(tmp_path, capsys):
    assert main(["audit-rewards", "--file", _file(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    f = _figures(out)
    assert f["rows"] == 8
    # rule: TP rows 1, 4, 7; FN rows 2, 6 (6 ungraded); TN rows 3, 5, 8: precision 3/3, recall 3/5
    assert _counts(f["rule"]) == (3, 0, 2, 3, {"unreadable_reference": 1})
    assert (f["rule"]["precision"], f["rule"]["recall"]) == (1.0, 0.6)
    # math-verify: TP row 1; FP rows 5, 8; FN rows 2, 4, 6, 7; TN row 3: precision 1/3, recall 1/5
    assert _counts(f["math-verify"]) == (1, 2, 4, 1, {})
    assert (f["math-verify"]["precision"], f["math-verify"]["recall"]) == (0.3333, 0.2)
    assert SPLIT_NOTE not in out  # a user's own `added` says what it says: the note is the shipped set's
    # each group of the file's own `added`, apart
    assert _counts(f["rule"]["early"]) == (2, 0, 1, 1, {}) and _counts(f["rule"]["late"]) == (1, 0, 1, 2,
                                                                                               {"unreadable_reference": 1})
    assert _counts(f["math-verify"]["early"]) == (1, 0, 2, 1, {}) and _counts(f["math-verify"]["late"]) == (0, 2, 2, 0, {})
    lines = out.splitlines()
    assert lines[0] == f"auditing the rule and math-verify alone on {tmp_path / 'rows.jsonl'} (8 rows)"
    assert lines[2].split() == ["rule", "1.000", "0.600", "3", "0", "2", "3", "8", "1", "(unreadable_reference", "1)"]
    assert "rule + appeal: skipped, no judge given" in out and "appeal" not in f


def test_the_shipped_set_is_reported_before_and_after_the_rule_was_tuned_on_it(capsys):
    pairs = audit_pairs(seed=0)
    tuned = [p for p in pairs if p.added == AFTER_TUNING]
    assert {p.kind for p in tuned} == set(TUNED_FOR) and len(tuned) == 114
    assert all(p.added == BEFORE_TUNING for p in pairs if p.kind not in TUNED_FOR)
    assert main(["audit-rewards", "--json"]) == 0
    out = capsys.readouterr().out
    f = _figures(out)
    assert f["rows"] == 506
    for checker in ("rule", "math-verify"):
        before, after = f[checker][BEFORE_TUNING], f[checker][AFTER_TUNING]
        assert sum(_counts(before)[:4]) == 392 and sum(_counts(after)[:4]) == 114
        assert before["tp"] + after["tp"] == f[checker]["tp"] and before["fp"] + after["fp"] == f[checker]["fp"]
    # math-verify alone misses most of the forms the rule was tuned to read: the split is what shows it
    assert f["math-verify"][AFTER_TUNING]["recall"] < f["math-verify"][BEFORE_TUNING]["recall"]
    assert any(line.split()[0] == BEFORE_TUNING for line in out.splitlines())
    assert any(line.split()[0] == AFTER_TUNING for line in out.splitlines())
    # and said where it is printed: neither group is held out from the rule, its 1.000 on them is by construction
    assert SPLIT_NOTE in out.splitlines()


@pytest.mark.parametrize("text, expected", [
    ('{"reference": "1", "answer": "1", "equal": true}\n{"reference": "2", "answer": "2"}\n',
     "row 2: no field 'equal'"),
    ('{"reference": "1", "answer": "1", "equal": "yes"}\n', "row 1: field 'equal' must be true or false, got \"yes\""),
    ('{"reference": "1", "answer": "1", "equal": true}\n\n{"reference": "2", "answer": 2, "equal": false}\n',
     "row 3: field 'answer' must be a string, got 2"),
    ('{"reference": "1", "answer": "1", "equal": true}\n{"reference": "2", "answer": "2", "equal": tru}\n',
     "row 2: not JSON"),
])
def test_a_bad_row_fails_in_one_line_naming_the_file_row_and_field_before_any_grading(tmp_path, capsys, text,
                                                                                        expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    assert main(["audit-rewards", "--file", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing graded, not even the first line: the file is read whole first
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"r1: {path}: {expected}"), captured.err


def _verdict(question: str) -> str:
    """A judge right about a fraction in words, wrong about a mixed number, silent about an interval."""
    if "<answer>one half</answer>" in question or "<answer>4 2/3</answer>" in question:
        return "yes"
    return "maybe" if "<answer>(-7, -3)</answer>" in question else "no"


def test_rule_and_appeal_through_an_http_judge(tmp_path, capsys):
    with scripted_judge(_verdict) as (url, handler):
        assert main(["audit-rewards", "--file", _file(tmp_path), "--judge", url, "--json"]) == 0
    out = capsys.readouterr().out
    f = _figures(out)
    # the rule's 0.0s go to the judge: rows 2, 3, 5, 8 (row 6 is ungraded, not a 0.0: never asked)
    assert len(handler.asked) == 4 and all("Reference answer:" in q for q in handler.asked)
    # row 2 upheld (TP), row 8 upheld (FP), row 5 no verdict (the rule's TN stands), row 3 no (TN)
    assert _counts(f["rule + appeal"]) == (4, 1, 1, 2, {"unreadable_reference": 1})
    assert (f["rule + appeal"]["precision"], f["rule + appeal"]["recall"]) == (0.8, 0.8)
    assert f["appeal"] == {"asked": 4, "upheld": 2, "no_verdict": {"judge_no_verdict": 1},
                           "calls_per_1000_rows": 500.0}
    assert _counts(f["rule"]) == (3, 0, 2, 3, {"unreadable_reference": 1})  # the rule alone, as without a judge
    assert (f"rule + appeal: judge 'judge' at {url} asked about 4 of 8 rows (500.0 calls per 1,000 rows), upheld 2, "
            f"no verdict 1 (judge_no_verdict 1)") in out


def test_the_judge_from_a_recipe_and_one_that_does_not_answer(tmp_path, capsys):
    with scripted_judge("yes") as (url, handler):
        recipe = tmp_path / "mine.yaml"
        recipe.write_text(f"name: mine\nreasoning_grpo:\n  grpo:\n    grading:\n      appeal:\n        backend: http\n"
                          f"        base_url: {url}\n        model: judge\n")
        assert main(["audit-rewards", "--file", _file(tmp_path), "--recipe", str(recipe), "--json"]) == 0
    f = _figures(capsys.readouterr().out)
    assert f["appeal"]["asked"] == len(handler.asked) == 4 and f["rule + appeal"]["fp"] == 3  # yes to rows 3, 5, 8
    assert main(["audit-rewards", "--file", _file(tmp_path), "--judge", url]) == 2  # the server is gone now
    err = capsys.readouterr().err
    assert err.startswith(f"r1: judge: could not reach judge at {url}/models") and err.count("\n") == 1
