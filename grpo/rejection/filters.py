"""Readability filters and drop reasons for rejection sampling: each filter takes one response and says
whether it passes and, if not, why; every generated sample is counted as kept or dropped for exactly one reason.

Pure Python and pandas; must not depend on torch, Prefect or MLflow.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from typing import Any, Callable, NamedTuple

from grpo.configs.rejection import READABILITY_FILTERS, RejectionConfig
from grpo.rewards import extract_answer
from grpo.rewards.language import LANGUAGE_TESTS, words_of
from grpo.texts import ANSWER_CLOSE, REASONING_TAGS, THINK_CLOSE, THINK_OPEN

# ----------------------------------------------------------------------------------------------------------------
# Readability filters: each takes one response and says whether it passes and, if not, why.

class Check(NamedTuple):
    ok: bool
    reason: str  # why it failed, for people; "" when it passed


PASSED = Check(True, "")


def _reasoning(response: str) -> str:
    """The think block; without tags, the whole text (so each filter also works on a response with broken tags)."""
    start, end = response.find(THINK_OPEN), response.find(THINK_CLOSE)
    if end == -1:
        return response[start + len(THINK_OPEN):] if start != -1 else response
    return response[start + len(THINK_OPEN) if 0 <= start < end else 0: end]


def check_tags(response: str, cfg: RejectionConfig) -> Check:
    """Exactly `<think>...</think><answer>...</answer>`: each tag once, in order, only whitespace around the blocks."""
    wrong = [f"{tag} x{response.count(tag)}" for tag in REASONING_TAGS if response.count(tag) != 1]
    if wrong:
        return Check(False, f"expected each tag once, found {', '.join(wrong)}")
    t_open, t_close, a_open, a_close = (response.index(tag) for tag in REASONING_TAGS)
    if not t_open < t_close < a_open < a_close:
        return Check(False, "tags out of order")
    if response[:t_open].strip():
        return Check(False, "text before <think>")
    if response[t_close + len(THINK_CLOSE): a_open].strip():
        return Check(False, "text between </think> and <answer>")
    if response[a_close + len(ANSWER_CLOSE):].strip():
        return Check(False, "text after </answer>")
    return PASSED


def check_language(response: str, cfg: RejectionConfig) -> Check:
    """At least `min_language_share` of the reasoning's words in `cfg.language`; no words (only math) passes."""
    words = words_of(_reasoning(response))
    if not words:  # unlike the RL reward (which must not pay for dropping the reasoning), nothing here is mixed
        return PASSED
    share = sum(map(LANGUAGE_TESTS[cfg.language], words)) / len(words)
    if share < cfg.min_language_share:
        return Check(False, f"{share:.0%} of the reasoning's words are {cfg.language}, "
                            f"need {cfg.min_language_share:.0%}")
    return PASSED


def check_paragraph_length(response: str, cfg: RejectionConfig) -> Check:
    """No paragraph (text between blank lines) longer than `max_paragraph_chars`."""
    longest = max(len(p.strip()) for p in re.split(r"\n\s*\n", response))
    if longest > cfg.max_paragraph_chars:
        return Check(False, f"a paragraph of {longest} chars (limit {cfg.max_paragraph_chars})")
    return PASSED


def check_reasoning_length(response: str, cfg: RejectionConfig) -> Check:
    """A think block of at most `max_reasoning_chars`."""
    length = len(_reasoning(response))
    if length > cfg.max_reasoning_chars:
        return Check(False, f"reasoning of {length} chars (limit {cfg.max_reasoning_chars})")
    return PASSED


def check_code_in_reasoning(response: str, cfg: RejectionConfig) -> Check:
    """No fenced code block inside the reasoning (R1 drops them; leave this filter out for code tasks)."""
    if "```" in _reasoning(response):
        return Check(False, "code block in the reasoning")
    return PASSED


def check_empty_answer(response: str, cfg: RejectionConfig) -> Check:
    """A non-empty answer block."""
    if not extract_answer(response):
        return Check(False, "empty or missing answer")
    return PASSED


_SEGMENT_SPLIT = re.compile(r"\n|(?<=[.!?])\s+")
_TAG = re.compile("|".join(map(re.escape, REASONING_TAGS)))


def check_repetition(response: str, cfg: RejectionConfig) -> Check:
    """No line or sentence repeated more than `max_line_repeats` times, and no text that compresses like a loop.

    The compression ratio catches loops without line or sentence breaks ("1111...", "the the the ..."); it is only
    measured from 400 characters, below which zlib's overhead dominates.
    """
    text = _TAG.sub("\n", response)  # a tag is a boundary, not part of the line next to it
    segments = Counter(" ".join(s.lower().split()) for s in _SEGMENT_SPLIT.split(text))
    repeated = [(s, k) for s, k in segments.items() if len(s) >= 8 and k > cfg.max_line_repeats]
    if repeated:
        segment, times = max(repeated, key=lambda sk: sk[1])
        return Check(False, f"{segment[:40]!r} repeated {times} times (limit {cfg.max_line_repeats})")
    raw = response.encode()
    if len(raw) >= 400:
        ratio = len(zlib.compress(raw)) / len(raw)
        if ratio < cfg.min_compression_ratio:
            return Check(False, f"compresses to {ratio:.2f} of its size (looping; limit {cfg.min_compression_ratio})")
    return PASSED


ReadabilityFilter = Callable[[str, RejectionConfig], Check]
READABILITY_CHECKS: dict[str, ReadabilityFilter] = {
    "tags": check_tags,
    "language": check_language,
    "paragraph_length": check_paragraph_length,
    "reasoning_length": check_reasoning_length,
    "code_in_reasoning": check_code_in_reasoning,
    "empty_answer": check_empty_answer,
    "repetition": check_repetition,
}
assert tuple(READABILITY_CHECKS) == READABILITY_FILTERS, "grpo.configs.rejection.READABILITY_FILTERS names these filters"


def first_failed_filter(response: str, cfg: RejectionConfig) -> str | None:
    """The name of the first filter in `cfg.filters` that `response` fails, or None."""
    for name in cfg.filters:
        if not READABILITY_CHECKS[name](response, cfg).ok:
            return name
    return None


# ----------------------------------------------------------------------------------------------------------------
# Counts: every generated sample is kept or dropped for exactly one reason

DUPLICATE = "duplicate"  # repeats an earlier sample of the same prompt
UNVERIFIABLE = "unverifiable"  # no usable reference and no judge to ask
INCORRECT = "incorrect"  # the rule check says the answer is wrong
JUDGE_REJECTED = "judge_rejected"
JUDGE_UNPARSEABLE = "judge_unparseable"  # older counts: the judge's output had no verdict (now ungraded)
UNGRADED = "ungraded"  # a sample's drop_reason when neither check could grade it (`Counts.ungraded` says why)
PER_PROMPT_CAP = "per_prompt_cap"  # correct, but the prompt already has max_kept_per_prompt rows
DUPLICATE_ACROSS_SHARDS = "duplicate_across_shards"  # merge: the same prompt and response in another shard
CONTAMINATED = "contaminated"  # merge: shares too many word n-grams with a held-out problem
OVER_TARGET = "over_target"  # merge: beyond the reasoning rows the target asks for


def drop_reasons(cfg: RejectionConfig) -> list[str]:
    """Every reason a sample can be dropped for, in the order the checks run."""
    return [*cfg.filters, DUPLICATE, UNVERIFIABLE, INCORRECT, JUDGE_REJECTED, PER_PROMPT_CAP,
            DUPLICATE_ACROSS_SHARDS, CONTAMINATED, OVER_TARGET]


class Counts(NamedTuple):
    """What happened to the samples of a shard or a whole run: generated == kept + sum(dropped.values()) +
    sum(ungraded.values()). An ungraded sample (its check timed out, its sandbox or judge failed: see
    `grpo.rewards.outcomes`) is neither kept nor rejected: it is counted by why."""

    generated: int  # completions sampled
    kept: int  # rows kept
    dropped: dict[str, int]  # drop reason -> samples dropped for it (first failing check only)
    truncated: int  # samples that ran out of token budget, whatever became of them
    rule_checked: int  # samples given a verdict by the rule check
    judge_asked: int  # samples sent to the judge
    judge_accepted: int  # of those, accepted
    judge_unparseable: int  # of those, no readable verdict
    both_checked: int  # samples with a verdict from both the rule and the judge (judge_when="always")
    agreed: int  # of those, the verdicts agree
    ungraded: dict[str, int] | None = None  # reason -> samples no check could grade (None: none, older counts)
    appeal_upheld: int = 0  # judge_when="appeal": samples the rule said incorrect and the judge's yes kept

    @classmethod
    def zero(cls, cfg: RejectionConfig) -> "Counts":
        return cls(0, 0, dict.fromkeys(drop_reasons(cfg), 0), 0, 0, 0, 0, 0, 0, 0, {})

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Counts":
        return cls(**d)

    def plus(self, other: "Counts") -> "Counts":
        """Both counts summed, field by field (a shard's counts plus another's)."""
        dropped, ungraded = dict(self.dropped), dict(self.ungraded or {})
        for reason, n in other.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
        for reason, n in (other.ungraded or {}).items():
            ungraded[reason] = ungraded.get(reason, 0) + n
        summed = {k: a + b for (k, a), b in zip(self._asdict().items(), other) if k not in ("dropped", "ungraded")}
        return Counts(**summed, dropped=dropped, ungraded=ungraded)

    def metrics(self, prefix: str = "rejection/") -> dict[str, float]:
        """Flat figures for a metrics logger: rejection/generated, rejection/dropped/tags, ..."""
        out = {f"{prefix}{k}": float(v) for k, v in self._asdict().items() if k not in ("dropped", "ungraded")}
        out.update({f"{prefix}dropped/{k}": float(v) for k, v in self.dropped.items()})
        ungraded = self.ungraded or {}
        out[f"{prefix}ungraded"] = float(sum(ungraded.values()))
        out.update({f"{prefix}ungraded/{k}": float(v) for k, v in ungraded.items()})
        out[f"{prefix}keep_rate"] = self.kept / self.generated if self.generated else 0.0
        if self.both_checked:
            out[f"{prefix}judge_rule_agreement"] = self.agreed / self.both_checked
        return out


def summary_line(metrics: dict[str, float], prefix: str = "rejection/") -> str:
    """What a person wants from `Counts.metrics()` (plus the merge's row counts), on one line: what was kept, the
    keep rate, and only the filters that dropped something, largest first.

    >>> summary_line({"rejection/generated": 8, "rejection/kept": 2, "rejection/keep_rate": 0.25,
    ...               "rejection/dropped/tags": 0, "rejection/dropped/incorrect": 6})
    'kept 2 of 8 samples (keep rate 0.250); dropped: incorrect 6'
    """
    def n(key: str) -> int:
        return int(metrics.get(prefix + key, 0))

    line = f"kept {n('kept')} of {n('generated')} samples (keep rate {metrics.get(prefix + 'keep_rate', 0.0):.3f})"
    if prefix + "rows" in metrics:
        line += f", {n('rows')} rows" + (f" with {n('non_reasoning_rows')} non-reasoning" if n("non_reasoning_rows")
                                         else "")
    dropped = {k[len(prefix + "dropped/"):]: int(v) for k, v in metrics.items() if k.startswith(prefix + "dropped/")}
    if any(dropped.values()):
        line += "; dropped: " + ", ".join(f"{k} {v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]) if v)
    if n("ungraded"):
        why = {k[len(prefix + "ungraded/"):]: int(v) for k, v in metrics.items()
               if k.startswith(prefix + "ungraded/") and v}
        line += f"; {n('ungraded')} ungraded (" + ", ".join(f"{k} {v}" for k, v in
                                                             sorted(why.items(), key=lambda kv: -kv[1])) + ")"
    if n("judge_asked"):
        line += f"; judge accepted {n('judge_accepted')} of {n('judge_asked')}"
    if n("truncated"):
        line += f"; {n('truncated')} truncated"
    return line
