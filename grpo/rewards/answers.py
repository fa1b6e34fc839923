"""Answer extraction: the last `<answer>…</answer>`, else the last `\\boxed{…}`.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from grpo.rewards.text import completion_text
from grpo.texts import ANSWER_TAGS

_BOXED_RE = re.compile(r"\\boxed\s*\{")


def _balanced_group(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``text[start] == "{"``, or None if unclosed.

    Escaped braces (``\\{``, ``\\}``) are literal characters, not grouping.
    """
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{…}`` (nested braces allowed), else None.

    A truncated last box (never closed) is skipped in favour of an earlier one.
    """
    for match in reversed(list(_BOXED_RE.finditer(text))):
        content = _balanced_group(text, match.end() - 1)
        if content is not None:
            return content.strip()
    return None


def extract_answer(text: str, answer_tags: Sequence[str] = ANSWER_TAGS) -> str | None:
    """Content of the last ``<answer>…</answer>``, else of the last ``\\boxed{…}``, else None."""
    text = completion_text(text)
    a_open, a_close = answer_tags
    close = text.rfind(a_close)
    if close != -1:
        open_ = text.rfind(a_open, 0, close)
        if open_ != -1:
            return text[open_ + len(a_open) : close].strip()
    return extract_boxed(text)


LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")
LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")
PROSE_WORD_RE = re.compile(r"[A-Za-z]{4,}")


def strip_answer_wrapping(text: str) -> str:
    """Drop surrounding whitespace, a trailing full stop and one pair of $…$ or $$…$$."""
    s = text.strip()
    for _ in range(2):
        if s.endswith(".") and not s.endswith(".."):
            s = s[:-1].rstrip()
        for delim in ("$$", "$"):
            if len(s) > 2 * len(delim) and s.startswith(delim) and s.endswith(delim):
                s = s[len(delim) : -len(delim)].strip()
                break
    return s
