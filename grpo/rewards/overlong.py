"""The overlong penalty (DAPO): a soft penalty as a completion nears its token budget.

Pure Python; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from grpo.rewards.text import completion_text


def _soft_penalty(length: int, max_len: int, cache: int) -> float:
    if length <= max_len - cache:
        return 0.0
    if length > max_len:
        return -1.0
    return ((max_len - cache) - length) / cache


def overlong_penalty(
    completions: Sequence[Any],
    *,
    max_completion_length: int | Sequence[int] | None = None,
    soft_cache: int | None = None,
    completion_lengths: Sequence[int] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    **_: Any,
) -> list[float]:
    """DAPO's soft overlong punishment: 0 up to (max - cache), linear to -1 at max, -1 beyond.

    Lengths are token counts: ``completion_lengths`` if given, else the length
    of ``completion_ids`` (TRL passes those), else character counts (with a
    warning: characters are not tokens). ``soft_cache`` defaults to a fifth of
    the maximum (DAPO: 4096 of 20480). Use ``make_overlong_penalty`` to fix
    the settings.
    """
    n = len(completions)
    if max_completion_length is None:
        raise ValueError("overlong_penalty needs max_completion_length (or use make_overlong_penalty)")
    if isinstance(max_completion_length, numbers.Integral):
        max_lens = [int(max_completion_length)] * n
    else:
        max_lens = [int(m) for m in max_completion_length]
    if completion_lengths is not None:
        lengths = [int(x) for x in completion_lengths]
    elif completion_ids is not None:
        lengths = [len(ids) for ids in completion_ids]
    else:
        warnings.warn(
            "overlong_penalty: no completion_lengths/completion_ids, using character counts",
            RuntimeWarning,
            stacklevel=2,
        )
        lengths = [len(completion_text(c)) for c in completions]
    if len(lengths) != n or len(max_lens) != n:
        raise ValueError("lengths must align with completions")
    scores = []
    for length, max_len in zip(lengths, max_lens):
        cache = max_len // 5 if soft_cache is None else int(soft_cache)
        if max_len <= 0 or not 0 <= cache <= max_len:
            raise ValueError(f"need 0 <= soft_cache <= max_completion_length > 0, got {cache}, {max_len}")
        scores.append(_soft_penalty(length, max_len, cache) if cache else float(-(length > max_len)))
    return scores


def make_overlong_penalty(max_completion_length: int, soft_cache: int | None = None) -> Callable[..., list[float]]:
    """``overlong_penalty`` with fixed limits, e.g. for ``score_completions(registry=...)``."""
    overlong_penalty(["x"], max_completion_length=max_completion_length, soft_cache=soft_cache, completion_lengths=[0])

    def configured(completions: Sequence[Any], **kwargs: Any) -> list[float]:
        kwargs.update(max_completion_length=max_completion_length, soft_cache=soft_cache)
        return overlong_penalty(completions, **kwargs)

    configured.__name__ = configured.__qualname__ = "overlong_penalty"
    return configured
