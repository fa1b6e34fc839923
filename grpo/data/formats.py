"""Answer formats: how a dataset's answer column holds the reference answer, and its worked solution.

| format | the column holds | reference | worked solution (the reasoning before it) |
|---|---|---|---|
| `plain` | the answer itself | the cell as text | none |
| `gsm8k` | a solution whose last line is `#### 1,234` | `1234` (the number after the last `####`, commas removed) | the text before `####`, without GSM8K's `<<48/2=24>>` calculator notes |
| `boxed` | a solution with `\\boxed{...}` (MATH) | the content of the last `\\boxed{...}` | the whole solution |

A reader returns None when the cell holds no answer in its format (for gsm8k, also when what follows `####` is not a
number: `#### seventy` could never be scored right); the loaders turn that into an error naming the file, row,
column and value, or drop the row where the recipe says so (`data.unreadable_answers`). Pure Python: must not
depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import re
from typing import Callable

from grpo.configs.data import ANSWER_FORMATS
from grpo.rewards.answers import extract_boxed

GSM8K_MARK = "####"
# what may follow "####" once thousands commas are out: GSM8K's answers are integers, but a sign, decimals or a
# plain fraction are numbers the accuracy reward can compare too
_GSM8K_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)(/\d+)?")
_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: "48/2 = <<48/2=24>>24"


def plain_answer(value) -> str | None:
    text = str(value).strip()
    return text or None


def gsm8k_answer(value) -> str | None:
    """`"...\\n#### 1,234"` -> `"1234"`; None without a `####` or with no number after it."""
    if not isinstance(value, str) or GSM8K_MARK not in value:
        return None
    answer = value.rsplit(GSM8K_MARK, 1)[1].strip().replace(",", "")
    return answer if _GSM8K_NUMBER.fullmatch(answer) else None


def boxed_answer(value) -> str | None:
    r"""`"... so the answer is $\boxed{\frac{1}{2}}$."` -> `"\frac{1}{2}"`."""
    if not isinstance(value, str):
        return None
    return extract_boxed(value) or None


def shown(fmt: str, value) -> str:
    """The part of a cell an error message shows: for gsm8k the text from its last `####` (where the answer should
    be, while the solution's start says nothing), else the cell's start."""
    if fmt == "gsm8k" and isinstance(value, str) and GSM8K_MARK in value:
        value = GSM8K_MARK + value.rsplit(GSM8K_MARK, 1)[1]
    return f"{value!r:.80}"


def gsm8k_reasoning(value: str) -> str:
    return _CALCULATOR_NOTE.sub("", value.rsplit(GSM8K_MARK, 1)[0]).strip()


def boxed_reasoning(value: str) -> str:
    return value.strip()


ANSWER_READERS: dict[str, Callable[[object], str | None]] = {
    "plain": plain_answer,
    "gsm8k": gsm8k_answer,
    "boxed": boxed_answer,
}
# formats whose column holds a worked solution, so SFT responses can be built from it
REASONING_READERS: dict[str, Callable[[str], str]] = {"gsm8k": gsm8k_reasoning, "boxed": boxed_reasoning}
EXPECTED = {  # what a cell of each format must hold, for error messages
    "plain": "an answer",
    "gsm8k": "a solution ending in a '#### <number>' line",
    "boxed": "a solution with a \\boxed{...} answer",
}
assert tuple(ANSWER_READERS) == ANSWER_FORMATS, "grpo.configs.data.ANSWER_FORMATS names these formats"
