"""The rule step verifiers: where steps end in the text and whether each holds (hand-written completions)."""

from fractions import Fraction

import pytest

from grpo.configs.data import TaskConfig
from grpo.configs.grading import STEP_VERIFIERS
from grpo.data.arithmetic import format_response, generate_problems
from grpo.rewards.steps import (
    STEP_VERIFIER_FUNCTIONS,
    Steps,
    arithmetic_steps,
    check_steps,
    evaluate_expression,
    gsm8k_steps,
    line_equations,
)


def test_the_synthetic_tasks_worked_solutions_hold_step_by_step_recalled_or_counted():
    problems = generate_problems(TaskConfig(max_operand=9), 30, "train")
    for counting in (False, True):
        texts = [format_response(p, counting=counting) for p in problems]
        steps = arithmetic_steps(texts, prompts=[p.question for p in problems])
        for p, text, s in zip(problems, texts, steps):
            assert s.rewards == (1.0,) * len(p.steps), text
            # each step ends right after its period, inside the think block
            assert [text[e - 1] for e in s.ends] == ["."] * len(p.steps)
            assert all(e <= text.index("</think>") for e in s.ends)


def test_a_wrong_result_a_wrong_count_and_a_miscopied_number_are_wrong_steps():
    prompt = "Ben has 9 apples, buys 3 and gives away 2. How many are left?"
    text = "<think>Given 9, 3, 2. 9 + 3 = 10 11 12. 12 - 2 = 10.</think><answer>10</answer>"
    assert arithmetic_steps([text], prompts=[prompt]) == [Steps((text.index("12. ") + 3, text.index("</think>")),
                                                                 (1.0, 1.0))]
    cases = {
        "<think>9 + 3 = 13. 13 - 2 = 11.</think><answer>11</answer>": (0.0, 1.0),  # then right from what it claimed
        "<think>9 + 3 = 10 12. 12 - 2 = 10.</think><answer>10</answer>": (0.0, 1.0),  # a count that skips
        "<think>9 + 4 = 13. 13 - 2 = 11.</think><answer>11</answer>": (0.0, 1.0),  # 4 is not in the problem
        "<think>9 + 3 = 12. 12 - 5 = 7.</think><answer>7</answer>": (1.0, 0.0),  # neither is 5
        "<think>2 * 3 = 4 5 6.</think><answer>6</answer>": (0.0,),  # products are not counted out
    }
    for text, rewards in cases.items():
        assert arithmetic_steps([text], prompts=[prompt])[0].rewards == rewards, text
    # without the prompts only the arithmetic is checked: 9 + 4 = 13 holds
    assert arithmetic_steps(["<think>9 + 4 = 13.</think>"])[0].rewards == (1.0,)


def test_no_equation_in_the_reasoning_is_no_step():
    texts = ["<think>I add them up.</think><answer>12</answer>", "<think>hm</think><answer>1 + 1 = 2</answer>", ""]
    assert arithmetic_steps(texts) == [Steps()] * 3
    # no think block: the reasoning is what comes before the answer
    assert arithmetic_steps(["1 + 1 = 2. <answer>2</answer>"])[0] == Steps((10,), (1.0,))


NATALIA = ("<think>Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
           "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.</think><answer>72</answer>")


def test_gsm8k_lines_with_calculator_annotations():
    (s,) = gsm8k_steps([NATALIA])
    assert s.rewards == (1.0, 1.0)
    assert [NATALIA[:e].rsplit("\n", 1)[-1][-6:] for e in s.ends] == ["n May.", "d May."]
    wrong = NATALIA.replace("<<48+24=72>>72", "<<48+24=70>>70")
    assert gsm8k_steps([wrong])[0].rewards == (1.0, 0.0)
    # an annotation that is right beside a plain equation that is wrong: the line is wrong
    assert line_equations("48/2 = <<48/2=24>>25 clips") == [True, False]


def test_gsm8k_plain_equations_money_percent_and_rounding():
    text = ("<think>He pays $1,200 / 4 = $300 a week.\nThat is 5 x 3 = 15 hours.\nSo we think.\n"
            "Each gets 10 / 3 = 3.33 pies.\nAnd 20% * 50 = 10 more.\nBut 3 + 4 = 8.</think><answer>8</answer>")
    (s,) = gsm8k_steps([text])
    assert s.rewards == (1.0, 1.0, 1.0, 1.0, 0.0)  # the line without an equation is not a step
    assert text[s.ends[-1] - 6 : s.ends[-1]] == "4 = 8."


def test_expressions_are_evaluated_never_executed():
    assert evaluate_expression("(48 + 24) / 2") == Fraction(36)
    for bad in ("__import__('os').system('true')", "2 ** 10", "abs(-3)", "4 +"):
        with pytest.raises(ValueError, match="not an arithmetic expression"):
            evaluate_expression(bad)
    assert line_equations("<<1/0=3>>") == [False]  # division by zero is a wrong step, not a crash


def test_registry_and_output_checks():
    assert set(STEP_VERIFIER_FUNCTIONS) | {"prm"} == set(STEP_VERIFIERS)
    with pytest.raises(ValueError, match="returned 1 step lists for 2 completions"):
        check_steps([Steps()], 2, "arithmetic")
    with pytest.raises(ValueError, match="completion 0's step ends \\[5, 3\\] are not in order"):
        check_steps([Steps((5, 3), (1.0, 1.0))], 1)
    with pytest.raises(ValueError, match="completion 0 has 1 step ends and 2 rewards"):
        check_steps([Steps((5,), (1.0, 1.0))], 1)


def test_held_out_step_accuracy_is_the_share_of_written_steps_that_hold():
    from grpo.evaluate import step_accuracy

    texts = ["<think>2 + 3 = 5. 5 * 2 = 11.</think><answer>11</answer>",  # one right, one wrong
             "<think>4 - 1 = 3.</think><answer>3</answer>",  # right
             "<answer>7</answer>"]  # no step written: counts nothing
    prompts = ["2 and 3, doubled", "4, minus 1", "7"]
    assert step_accuracy(texts, prompts, "arithmetic") == 2 / 3
    assert step_accuracy(texts[2:], prompts[2:], "arithmetic") is None
    assert step_accuracy(["<think>Tom has 2*3=<<2*3=6>>6 apples.</think><answer>6</answer>"], ["q"], "gsm8k") == 1.0
