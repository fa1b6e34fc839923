"""Hand-picked checks of grpo.rewards (CPU; symbolic checks run in threads, some tests start the process pool)."""

from __future__ import annotations

import math

import pytest

from grpo.rewards.outcomes import TIMEOUT, Ungraded
from grpo.rewards import (
    REWARD_FUNCTIONS,
    RewardScores,
    UnknownRewardError,
    accuracy_reward,
    completion_text,
    extract_answer,
    format_reward,
    format_reward_strict,
    language_consistency_reward,
    make_format_reward,
    make_overlong_penalty,
    overlong_penalty,
    score_completions,
    tag_count_reward,
)

GOOD = "<think>\nadd them\n</think>\n<answer>\n5\n</answer>"


# ----------------------------------------------------------------- completion text


def test_completion_text_takes_last_assistant_message():
    chat = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "first"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "<answer>"}, {"type": "text", "text": "5</answer>"}
        ]},
    ]
    assert completion_text(chat) == "<answer>5</answer>"
    assert completion_text([{"role": "user", "content": "only user"}]) == "only user"
    assert completion_text(None) == ""


# ----------------------------------------------------------------- format


@pytest.mark.parametrize(
    "text, lenient, strict",
    [
        (GOOD, 1.0, 1.0),
        ("<think></think><answer>5</answer>", 1.0, 1.0),  # empty think block is still the structure
        ("  <think>a</think>\n\n<answer>5</answer>\n  ", 1.0, 1.0),  # whitespace around/between
        ("Sure! <think>a</think> so <answer>5</answer> done", 1.0, 0.0),  # text around the blocks
        ("<think>a</think><answer>5</answer> trailing", 1.0, 0.0),  # text after </answer>
        ("<think>a</think>between<answer>5</answer>", 1.0, 0.0),  # text between blocks
        ("<think>a</think><think>b</think><answer>5</answer>", 1.0, 0.0),  # think tag twice
        ("<answer>5</answer><think>a</think>", 0.0, 0.0),  # wrong order
        ("<think>a</think> 5", 0.0, 0.0),  # no answer block
        ("<think>a <answer>5</answer>", 0.0, 0.0),  # think never closed
        ("just 5", 0.0, 0.0),
    ],
)
def test_format_reward_lenient_and_strict(text, lenient, strict):
    assert format_reward([text]) == [lenient]
    assert format_reward([text], strict=True) == [strict]
    assert format_reward_strict([text]) == [strict]


def test_format_reward_prefilled_think():
    completion = "reasoning here\n</think>\n<answer>5</answer>"
    assert format_reward([completion]) == [0.0]  # no opening tag in the completion
    assert format_reward([completion], prefilled_think=True) == [1.0]
    assert format_reward([completion], prefilled_think=True, strict=True) == [1.0]
    # The template opened <think>; repeating it is a second opening tag.
    assert format_reward(["<think>" + completion], prefilled_think=True, strict=True) == [0.0]


def test_format_reward_custom_tags_chat_messages_and_factory():
    text = "<reasoning>r</reasoning><solution>5</solution>"
    chat = [{"role": "assistant", "content": text}]
    tags = {"think_tags": ("<reasoning>", "</reasoning>"), "answer_tags": ("<solution>", "</solution>")}
    assert format_reward([chat], strict=True, **tags) == [1.0]
    assert format_reward([chat]) == [0.0]  # default tags are absent
    custom = make_format_reward("reasoning_format", strict=True, **tags)
    assert custom.__name__ == "reasoning_format"
    assert custom([chat, GOOD], answer=["5", "5"]) == [1.0, 0.0]  # extra columns are ignored
    with pytest.raises(TypeError):
        make_format_reward(strcit=True)


def test_tag_count_reward():
    assert tag_count_reward([GOOD]) == [1.0]
    assert tag_count_reward(["<think>a</think><answer>5"]) == [0.75]
    assert tag_count_reward(["<think><think>a</think><answer>5</answer>"]) == [0.75]
    assert tag_count_reward(["nothing"]) == [0.0]
    prefilled = "a</think><answer>5</answer>"
    assert tag_count_reward([prefilled]) == [0.75]
    assert tag_count_reward([prefilled], prefilled_think=True) == [1.0]
    assert tag_count_reward(["<think>" + prefilled], prefilled_think=True) == [0.75]


# ----------------------------------------------------------------- extraction


def test_extract_answer_prefers_last_answer_block():
    text = "<answer>1</answer> then \\boxed{2} <answer> 3 </answer>"
    assert extract_answer(text) == "3"
    assert extract_answer("no tags, \\boxed{7}") == "7"
    assert extract_answer("nothing here") is None
    assert extract_answer("<answer>unclosed \\boxed{4}") == "4"


def test_extract_boxed_nested_and_escaped_braces():
    assert extract_answer("so \\boxed{\\frac{1}{\\sqrt{2}}}.") == "\\frac{1}{\\sqrt{2}}"
    assert extract_answer("\\boxed{1} and finally \\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    # A truncated last box is skipped in favour of the previous complete one.
    assert extract_answer("\\boxed{x^{2}} ... \\boxed{\\frac{1}{2") == "x^{2}"


# ----------------------------------------------------------------- accuracy


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("7,425,000", "7425000"),
        ("\\frac13", "1/3"),
        ("0.5", "1/2"),
        ("$277$", "277"),
        ("277.", "277"),
        ("\\dfrac{3}{4}", "0.75"),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),  # exact LaTeX shortcut
        ("x(x+3)", "x^2+3x"),  # exact LaTeX shortcut
        ("\\sqrt[3]{8}", "2"),  # symbolic path
        ("\\frac{2}{1+\\sqrt{3}}", "\\sqrt{3}-1"),  # symbolic path
        # whole answers in forms math-verify cannot read, rewritten first (grpo/rewards/forms.py)
        ("1e3", "1000"), ("-2.5E-4", "-0.00025"), ("1 000", "1000"), ("1\\,000", "1000"), ("3 1/2", "\\frac{7}{2}"),
        ("seven", "7"), ("Twenty-one", "21"), ("∞", "\\infty"),
        ("Monday.", "\\text{Monday}"), ("\\textbf{Yes}", "yes"), ("No.", "no"),  # a one-word reference: as a word
        ("cab", "abc"),  # three letters may be a product of symbols: still math-verify's
    ],
)
def test_accuracy_equivalences(pred, gold):
    assert accuracy_reward([f"<think>t</think><answer>{pred}</answer>"], [gold]) == [1.0]


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("7,425,001", "7425000"),
        ("1/4", "1/3"),
        ("0.51", "1/2"),
        ("-277", "277"),
        ("\\sqrt{3}", "\\sqrt{2}"),
        ("x^2+2x", "x^2+3x"),
        ("1e4", "1000"), ("1 0000", "1000"), ("3 1/4", "3.5"), ("seventy", "7"), ("twenty-two", "21"),
        ("Tuesday", "\\text{Monday}"), ("no", "yes"), ("3", "pi"),
    ],
)
def test_accuracy_wrong_answers(pred, gold):
    assert accuracy_reward([f"<answer>{pred}</answer>"], [gold]) == [0.0]


def test_accuracy_missing_answer_bad_reference_and_chat_input():
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "so \\boxed{12}"}]
    scores = accuracy_reward(
        ["no answer at all", chat, "<answer>5</answer>", "<answer>5</answer>", "no answer at all"],
        ["5", "12", "the answer", None, "Monday"],
        trainer_state=object(),  # unknown kwargs are ignored
    )
    assert scores == [0.0, 1.0, None, None, 0.0]
    # a table's empty cell read back as NaN (a general row of the alignment stage's mixed Parquet): no reference
    assert accuracy_reward(["<answer>5</answer>", "<answer>nan</answer>"], [math.nan, float("nan")]) == [None, None]


def test_accuracy_gsm8k_style_reference():
    assert accuracy_reward(["<answer>72</answer>"], ["She sold 48 + 24 = 72 clips.\n#### 72"]) == [1.0]


# ----------------------------------------------------------------- language consistency


def test_language_consistency():
    english = "<think>We add the two numbers to get five.</think><answer>5</answer>"
    mixed = "<think>we compute 我们计算</think><answer>5</answer>"  # 2 English words, 4 Han characters
    assert language_consistency_reward([english]) == [1.0]
    assert language_consistency_reward([mixed]) == [pytest.approx(2 / 6)]
    assert language_consistency_reward([mixed], language="zh") == [pytest.approx(4 / 6)]
    # Math, LaTeX commands and single-letter variables count for no language.
    # counted: "so", "and", 我, 们 -> 2 of 4 English
    assert language_consistency_reward(["<think>so $\\frac{ab}{cd}$ and x = 2 \\cdot 我们</think>"]) == [0.5]
    assert language_consistency_reward(["<think>2+2=4</think>", "<think></think>x"]) == [0.0, 0.0]
    # No think block: the whole completion; prefilled think: everything before </think>.
    assert language_consistency_reward(["只有中文"], language="zh") == [1.0]
    assert language_consistency_reward(["English reasoning</think><answer>中文</answer>"]) == [1.0]
    with pytest.raises(ValueError, match="supported"):
        language_consistency_reward(["x"], language="fr")


# ----------------------------------------------------------------- overlong


def test_overlong_penalty_soft_punishment():
    # max 100, cache 20: free up to 80, then linear to -1 at 100, -1 beyond.
    lengths = [50, 80, 90, 95, 100, 130]
    scores = overlong_penalty(["c"] * 6, max_completion_length=100, soft_cache=20, completion_lengths=lengths)
    assert scores == [0.0, 0.0, -0.5, -0.75, -1.0, -1.0]
    # TRL passes completion_ids: their lengths are the token counts.
    ids = [[1] * 7, [1] * 3]
    assert overlong_penalty(["a", "b"], max_completion_length=10, soft_cache=5, completion_ids=ids) == [-0.4, 0.0]
    # Default cache: a fifth of the maximum (DAPO's 4096 of 20480).
    assert overlong_penalty(["a"], max_completion_length=100, completion_lengths=[90]) == [-0.5]


def test_overlong_penalty_character_fallback_and_factory():
    with pytest.warns(RuntimeWarning, match="character"):
        assert overlong_penalty(["x" * 9], max_completion_length=10, soft_cache=2) == [-0.5]
    with pytest.raises(ValueError, match="max_completion_length"):
        overlong_penalty(["x"], completion_lengths=[1])
    penalty = make_overlong_penalty(100, soft_cache=20)
    assert penalty.__name__ == "overlong_penalty"
    assert penalty(["a", "b"], completion_lengths=[90, 10], answer=["1", "2"]) == [-0.5, 0.0]
    with pytest.raises(ValueError):
        make_overlong_penalty(100, soft_cache=200)


# ----------------------------------------------------------------- registry and scoring


def test_registry_names():
    names = {"format", "format_strict", "accuracy", "tag_count", "language_consistency", "overlong", "code"}
    assert set(REWARD_FUNCTIONS) == names
    assert REWARD_FUNCTIONS["format_strict"](["<think>a</think><answer>1</answer> x"]) == [0.0]


def test_score_completions_weights_hand_computed():
    completions = [GOOD, "<think>a</think> x <answer>4</answer> y", "nothing"]
    result = score_completions(
        completions,
        {"format": 1.0, "format_strict": 2.0, "tag_count": 0.5, "accuracy": 3.0},
        {"answer": ["5", "5", "5"]},
    )
    assert isinstance(result, RewardScores)
    assert result.per_function["format"] == [1.0, 1.0, 0.0]
    assert result.per_function["format_strict"] == [1.0, 0.0, 0.0]
    assert result.per_function["tag_count"] == [1.0, 1.0, 0.0]
    assert result.per_function["accuracy"] == [1.0, 0.0, 0.0]
    # 1*1 + 2*1 + 0.5*1 + 3*1 = 6.5 ; 1*1 + 0 + 0.5*1 + 0 = 1.5 ; 0
    assert result.total == [6.5, 1.5, 0.0]
    assert result.failures == {"format": 0, "format_strict": 0, "tag_count": 0, "accuracy": 0}


def _registry(**extra):
    return {"format": format_reward, **extra}


def test_score_completions_isolates_a_raising_completion():
    calls = []

    def picky(completions, **_):
        calls.append(len(completions))
        if "bad" in completions:
            raise RuntimeError("cannot score 'bad'")
        return [2.0] * len(completions)

    result = score_completions(["ok", "bad", "ok2"], [("picky", 1.0), ("format", 1.0)], registry=_registry(picky=picky))
    assert calls == [3, 1, 1, 1]  # batch first, then one by one
    assert result.per_function["picky"] == [2.0, None, 2.0]
    assert result.failures == {"picky": 1, "format": 0}
    assert result.total == [2.0, 0.0, 2.0]
    # the completion it raised on is ungraded, not scored 0: the loops leave it out
    assert result.ungraded == {"picky": [None, "raised", None], "format": [None, None, None]}
    assert result.graded == [True, False, True]
    assert result.reasons() == ["", "picky: raised", ""]
    assert result.ungraded_counts() == {("picky", "raised"): 1}


def test_a_reward_answering_ungraded_and_one_of_weight_0():
    def unsure(completions, **_):
        return [1.0, Ungraded(TIMEOUT, "too slow"), None]

    result = score_completions(["a", "b", "c"], {"unsure": 1.0, "watch": 0.0},
                               registry=_registry(unsure=unsure, watch=lambda completions, **_: 1 / 0))
    assert result.per_function["unsure"] == [1.0, None, None]
    assert result.ungraded["unsure"] == [None, "timeout", None] and result.skipped["unsure"] == 1
    # a function of weight 0 adds nothing to a reward, so its failures leave the rows graded (and are counted)
    assert result.graded == [True, False, True] and result.ungraded["watch"] == ["raised"] * 3
    assert result.take([2, 1]).graded == [True, False] and result.take([2, 1]).ungraded["unsure"] == [None, "timeout"]


def test_score_completions_nan_inf_non_numbers_and_none():
    def odd(completions, **_):
        return [math.nan, math.inf, "1.0", None, 0.5]

    result = score_completions(list("abcde"), {"odd": 2.0}, registry=_registry(odd=odd))
    assert result.per_function["odd"] == [None, None, None, None, 0.5]
    assert result.failures == {"odd": 3}  # NaN, inf and a string failed...
    assert result.ungraded["odd"] == ["not_a_number"] * 3 + [None, None] and result.graded == [False] * 3 + [True] * 2
    assert result.skipped == {"odd": 1}  # ...while None says the reward does not apply there
    assert result.total == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_a_reward_that_does_not_apply_is_skipped_not_failed():
    # accuracy needs a reference: rows without one (a general prompt mixed into alignment) are sat out, not errors
    result = score_completions([GOOD, GOOD], {"accuracy": 1.0, "format": 1.0}, {"answer": ["5", None]})
    assert result.per_function["accuracy"] == [1.0, None]
    assert result.failures == {"accuracy": 0, "format": 0} and result.skipped == {"accuracy": 1, "format": 0}
    assert result.total == [2.0, 1.0]


def test_score_completions_wrong_length_fails_every_completion():
    result = score_completions(
        [GOOD, GOOD], {"short": 1.0, "format": 1.0}, registry=_registry(short=lambda completions, **_: [1.0])
    )
    assert result.per_function["short"] == [None, None]
    assert result.failures["short"] == 2 and result.ungraded["short"] == ["wrong_length"] * 2
    assert result.total == [1.0, 1.0] and result.graded == [False, False]  # only format counted: no reward


def test_score_completions_passes_columns_per_completion_on_fallback():
    def needs_answer(completions, answer, **_):
        if len(completions) > 1:
            raise RuntimeError("batch broken")
        return [float(completions[0] == answer[0])]

    result = score_completions(["1", "2"], {"x": 1.0}, {"answer": ["1", "3"]}, registry={"x": needs_answer})
    assert result.per_function["x"] == [1.0, 0.0]
    assert result.failures == {"x": 0}


def test_score_completions_bad_specs_raise_before_scoring():
    calls = []

    def spy(completions, **_):
        calls.append(1)
        return [1.0] * len(completions)

    registry = _registry(spy=spy)
    with pytest.raises(UnknownRewardError) as err:
        score_completions(["a"], {"spy": 1.0, "acuracy": 1.0}, registry=registry)
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    assert "acuracy" in str(err.value) and "format" in str(err.value) and "spy" in str(err.value)
    with pytest.raises(ValueError):
        score_completions(["a"], [("spy", 1.0), ("spy", 2.0)], registry=registry)
    with pytest.raises(ValueError):
        score_completions(["a"], {"spy": math.nan}, registry=registry)
    with pytest.raises(ValueError):
        score_completions(["a", "b"], {"spy": 1.0}, {"answer": ["1"]}, registry=registry)
    assert calls == []
    with pytest.raises(KeyError, match="accuracy"):
        score_completions(["a"], {"nope": 1.0})  # default registry lists its names
