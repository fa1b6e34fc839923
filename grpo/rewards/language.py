"""Language consistency (R1): the share of the chain of thought's words in the target language.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

from grpo.configs.grading import LANGUAGES
from grpo.rewards.answers import LATEX_COMMAND_RE
from grpo.rewards.text import completion_text
from grpo.texts import THINK_TAGS

_MATH_SEGMENT_RE = re.compile(r"\$\$.*?\$\$|\$[^$]*\$|\\\(.*?\\\)|\\\[.*?\\\]", re.DOTALL)


def _is_han(ch: str) -> bool:
    cp = ord(ch)
    return (
        0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF
        or 0x20000 <= cp <= 0x2EBEF or 0x30000 <= cp <= 0x3134F
    )  # fmt: skip


def _is_latin(ch: str) -> bool:
    return ch.isascii() or "LATIN" in unicodedata.name(ch, "")


def words_of(text: str) -> list[str]:
    """Word-like tokens: runs of letters, each Han character on its own
    (Chinese has no spaces). Math segments, LaTeX commands and single Latin
    letters (variables like x, n) are dropped: they belong to no language."""
    text = LATEX_COMMAND_RE.sub(" ", _MATH_SEGMENT_RE.sub(" ", text))
    words, current = [], []
    for ch in text:
        if ch.isalpha() and not _is_han(ch):
            current.append(ch)
            continue
        if current:
            words.append("".join(current))
            current = []
        if _is_han(ch):
            words.append(ch)
    if current:
        words.append("".join(current))
    return [w for w in words if not (len(w) == 1 and w.isascii())]


LANGUAGE_TESTS: dict[str, Callable[[str], bool]] = {
    "en": lambda word: all(_is_latin(ch) for ch in word),
    "zh": lambda word: all(_is_han(ch) for ch in word),
}
if set(LANGUAGE_TESTS) != set(LANGUAGES):  # what a recipe may ask (grpo.configs) is what can be checked here
    raise ImportError(f"grpo.rewards.language tests {sorted(LANGUAGE_TESTS)} but grpo.configs.grading.LANGUAGES offers "
                      f"{sorted(LANGUAGES)}: add the language to both")


def _chain_of_thought(text: str, think_tags: Sequence[str]) -> str:
    """The think block; with a prefilled opening tag, everything before the close; else all."""
    t_open, t_close = think_tags
    close = text.find(t_close)
    if close == -1:
        return text
    open_ = text.rfind(t_open, 0, close)
    return text[open_ + len(t_open) : close] if open_ != -1 else text[:close]


def language_consistency_reward(
    completions: Sequence[Any],
    *,
    language: str = "en",
    think_tags: Sequence[str] = THINK_TAGS,
    **_: Any,
) -> list[float]:
    """Share of the chain-of-thought's words that are in ``language`` (R1).

    en: words written in Latin script; zh: Han characters. A CoT with no
    countable words (empty, or only math) scores 0.0: the share is undefined,
    and dropping the reasoning must never earn this reward.
    """
    if language not in LANGUAGE_TESTS:
        raise ValueError(f"unsupported language {language!r}; supported: {sorted(LANGUAGE_TESTS)}")
    in_language = LANGUAGE_TESTS[language]
    scores = []
    for completion in completions:
        words = words_of(_chain_of_thought(completion_text(completion), think_tags))
        scores.append(sum(map(in_language, words)) / len(words) if words else 0.0)
    return scores
