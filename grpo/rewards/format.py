"""Format rewards: the `<think>…</think><answer>…</answer>` layout R1 asks for, and TRL's tag count.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from grpo.rewards.text import completion_text
from grpo.texts import ANSWER_TAGS, THINK_TAGS


def _has_format(
    text: str, *, strict: bool, think_tags: Sequence[str], answer_tags: Sequence[str]
) -> bool:
    t_open, t_close = map(re.escape, think_tags)
    a_open, a_close = map(re.escape, answer_tags)
    if strict:
        # Each tag exactly once, so ".*" below cannot swallow another block.
        if any(text.count(tag) != 1 for tag in (*think_tags, *answer_tags)):
            return False
        pattern = rf"\s*{t_open}.*{t_close}\s*{a_open}.*{a_close}\s*"
        return re.fullmatch(pattern, text, re.DOTALL) is not None
    pattern = rf"{t_open}.*?{t_close}.*?{a_open}.*?{a_close}"
    return re.search(pattern, text, re.DOTALL) is not None


def format_reward(
    completions: Sequence[Any],
    *,
    strict: bool = False,
    think_tags: Sequence[str] = THINK_TAGS,
    answer_tags: Sequence[str] = ANSWER_TAGS,
    prefilled_think: bool = False,
    **_: Any,
) -> list[float]:
    """1.0 for ``<think>…</think>…<answer>…</answer>``, else 0.0.

    lenient: the four tags in that order, any other text around them.
    strict: exactly that structure, each tag once, only whitespace between and
    around the blocks, nothing after ``</answer>``. Block contents are free
    (they may be empty) but may not contain the tags.
    prefilled_think: the chat template already opened the think block in the
    prompt, so the completion starts inside it (no opening tag expected; an
    opening tag in the completion counts as a second one).
    """
    scores = []
    for completion in completions:
        text = completion_text(completion)
        if prefilled_think:
            text = think_tags[0] + text
        ok = _has_format(text, strict=strict, think_tags=think_tags, answer_tags=answer_tags)
        scores.append(1.0 if ok else 0.0)
    return scores


def format_reward_strict(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """``format_reward`` with ``strict=True`` (a real function, so TRL can log its name)."""
    kwargs["strict"] = True
    return format_reward(completions, **kwargs)


def make_format_reward(name: str = "format_reward", **config: Any) -> Callable[..., list[float]]:
    """A ``format_reward`` with fixed settings (tags, strict, prefilled_think).

    Unlike functools.partial, the result has a ``__name__`` (TRL logs it).
    """
    unknown = set(config) - {"strict", "think_tags", "answer_tags", "prefilled_think"}
    if unknown:
        raise TypeError(f"make_format_reward got unknown settings: {sorted(unknown)}")

    def configured(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return format_reward(completions, **{**kwargs, **config})

    configured.__name__ = configured.__qualname__ = name
    return configured


def tag_count_reward(
    completions: Sequence[Any],
    *,
    think_tags: Sequence[str] = THINK_TAGS,
    answer_tags: Sequence[str] = ANSWER_TAGS,
    prefilled_think: bool = False,
    **_: Any,
) -> list[float]:
    """0.25 for each of the four tags that appears exactly once (open-r1).

    open-r1 counts the tags with their surrounding newlines; here the bare tags
    are counted, so the reward does not depend on whitespace style. With
    ``prefilled_think`` the opening think tag lives in the prompt: it earns its
    0.25 when the completion does not repeat it.
    """
    scores = []
    for completion in completions:
        text = completion_text(completion)
        score = 0.0
        for i, tag in enumerate((*think_tags, *answer_tags)):
            expected = 0 if (prefilled_think and i == 0) else 1
            if text.count(tag) == expected:
                score += 0.25
        scores.append(score)
    return scores
