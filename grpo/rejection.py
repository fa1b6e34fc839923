"""Stage 3, rejection sampling: many samples per prompt from the RL checkpoint; keep the correct, readable ones.

The R1 paper (section 2.3.3): sample several responses per prompt from the reasoning-RL checkpoint; keep only the
correct ones, checked by rule where the prompt has a verifiable answer and otherwise by a generative judge
(DeepSeek-V3 given the reference and the prediction); drop chains of thought with mixed languages, long paragraphs
or code blocks. About 600k reasoning samples plus 200k non-reasoning ones make the 800k rows of the next SFT stage.

Here one sample goes through `curate` in this order, and is counted under the first check it fails, so
generated = kept + sum(dropped):
  readability filters (`READABILITY_FILTERS`, in `cfg.filters` order) -> duplicate of an earlier sample of the
  same prompt -> correctness (rule, judge, or both) -> at most `max_kept_per_prompt` per prompt.
Truncation is counted but is no reason of its own: a response cut off by the token budget never closes its answer
block (the tag filter drops it), and one cut just after `</answer>` is whole.
The prompts are cut into shards of `shard_size`. Each shard samples under a seed of its own (cfg.seed, index), so a
shard sampled again gives the same samples, and is written as one Parquet file, atomically; a shard whose file
exists is not sampled again, so a crashed or cancelled run resumes without losing or duplicating rows.
`merge_shards` then dedupes across shards, drops rows that share word n-grams with held-out problems, caps the
reasoning rows to the target (prompt coverage first, deterministically) and appends the non-reasoning rows.

How it differs from the paper: the paper does not spell out its readability rules; the ones here (tag structure,
language share, paragraph and reasoning length, code in the reasoning, empty answer, repetition) are plain
functions with their thresholds in `RejectionConfig`. Sampling stops at the planned prompts, not at the target.

Run it alone:
    result = run_rejection_sampling(TransformersBackend(model, tok), prompts_df, RejectionConfig(), "out/rs")
    result.dataset  # prompt, response, ... ready for SFT
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm.auto import tqdm

from grpo.data import DataError, validate_rows
from grpo.generation import GenerationBackend, SamplingConfig
from grpo.judge import Judge, Verdict
# the same word split and script tests as the language-consistency reward, so the filter and the RL reward agree
from grpo.rewards import _LANGUAGE_TESTS, _words, accuracy_reward, extract_answer

THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE = "<think>", "</think>", "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)


class RejectionConfig(BaseModel):
    """Stage 3: rejection sampling (defaults are the tiny recipe's values)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    samples_per_prompt: int = Field(4, ge=1)  # completions sampled per prompt
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)  # completion budget and temperature
    target_samples: int = Field(400, ge=1)  # final rows, reasoning + non-reasoning (R1: 800k; tiny: hundreds)
    non_reasoning_rows: int = Field(0, ge=0)  # of target_samples, rows from the non-reasoning set (R1: 200k)
    max_kept_per_prompt: int = Field(2, ge=0)  # correct samples kept per prompt (0 = all): coverage over near-copies
    shard_size: int = Field(64, ge=1)  # prompts per shard: the unit that is written, skipped on resume, mapped over
    filters: tuple[str, ...] = ("tags", "language", "paragraph_length", "reasoning_length", "code_in_reasoning",
                                "empty_answer", "repetition")  # readability filters, in order (READABILITY_FILTERS)
    language: str = "en"  # the language the reasoning must be written in (R1 drops mixed-language chains of thought)
    min_language_share: float = Field(0.95, ge=0, le=1)  # least share of the reasoning's words in `language`
    max_paragraph_chars: int = Field(2000, ge=1)  # longest paragraph (text between blank lines) a response may have
    max_reasoning_chars: int = Field(8000, ge=1)  # longest think block in characters
    max_line_repeats: int = Field(3, ge=1)  # a line or sentence (8+ chars) seen more often than this is looping
    min_compression_ratio: float = Field(0.1, ge=0, le=1)  # zlib size / text size below this is looping
    # "no_reference": judge rows without an answer; "always": also ask it where the rule decides, to measure their
    # agreement; "never": drop rows without an answer
    judge_when: Literal["no_reference", "always", "never"] = "no_reference"
    dedupe: bool = True  # drop samples whose normalised text repeats an earlier one of the same prompt
    decontamination_ngram: int = Field(8, ge=0)  # word n-gram length matched against held-out prompts (0 = off)
    # share of a held-out prompt's n-grams that marks a row (on the tiny task 0.5 flags 39% of the training
    # problems, which share template wording with held-out ones; a copied problem shares about 90%)
    decontamination_threshold: float = Field(0.8, gt=0, le=1)
    seed: int = 0  # each shard's sampling seed derives from it; also the tie-break when capping to the target

    @model_validator(mode="after")
    def _check(self) -> "RejectionConfig":
        unknown = [f for f in self.filters if f not in READABILITY_FILTERS]
        if unknown:
            raise ValueError(f"unknown readability filter(s) {unknown}; known: {list(READABILITY_FILTERS)}")
        if self.language not in _LANGUAGE_TESTS:
            raise ValueError(f"unsupported language {self.language!r}; supported: {sorted(_LANGUAGE_TESTS)}")
        if self.non_reasoning_rows >= self.target_samples:
            raise ValueError(f"non_reasoning_rows ({self.non_reasoning_rows}) must be below target_samples "
                             f"({self.target_samples}): the rest of the target is reasoning rows")
        return self


# Fields that only `merge_shards` reads: changing them between runs keeps the shards already written.
MERGE_ONLY_FIELDS = ("target_samples", "non_reasoning_rows", "decontamination_ngram", "decontamination_threshold")


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
    wrong = [f"{tag} x{response.count(tag)}" for tag in TAGS if response.count(tag) != 1]
    if wrong:
        return Check(False, f"expected each tag once, found {', '.join(wrong)}")
    t_open, t_close, a_open, a_close = (response.index(tag) for tag in TAGS)
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
    words = _words(_reasoning(response))
    if not words:  # unlike the RL reward (which must not pay for dropping the reasoning), nothing here is mixed
        return PASSED
    share = sum(map(_LANGUAGE_TESTS[cfg.language], words)) / len(words)
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
_TAG = re.compile("|".join(map(re.escape, TAGS)))


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
READABILITY_FILTERS: dict[str, ReadabilityFilter] = {
    "tags": check_tags,
    "language": check_language,
    "paragraph_length": check_paragraph_length,
    "reasoning_length": check_reasoning_length,
    "code_in_reasoning": check_code_in_reasoning,
    "empty_answer": check_empty_answer,
    "repetition": check_repetition,
}


def first_failed_filter(response: str, cfg: RejectionConfig) -> str | None:
    """The name of the first filter in `cfg.filters` that `response` fails, or None."""
    for name in cfg.filters:
        if not READABILITY_FILTERS[name](response, cfg).ok:
            return name
    return None


# ----------------------------------------------------------------------------------------------------------------
# Counts: every generated sample is kept or dropped for exactly one reason

DUPLICATE = "duplicate"  # repeats an earlier sample of the same prompt
UNVERIFIABLE = "unverifiable"  # no usable reference and no judge to ask
INCORRECT = "incorrect"  # the rule check says the answer is wrong
JUDGE_REJECTED = "judge_rejected"
JUDGE_UNPARSEABLE = "judge_unparseable"  # the judge's output could not be read as a verdict
PER_PROMPT_CAP = "per_prompt_cap"  # correct, but the prompt already has max_kept_per_prompt rows
DUPLICATE_ACROSS_SHARDS = "duplicate_across_shards"  # merge: the same prompt and response in another shard
CONTAMINATED = "contaminated"  # merge: shares too many word n-grams with a held-out problem
OVER_TARGET = "over_target"  # merge: beyond the reasoning rows the target asks for


def drop_reasons(cfg: RejectionConfig) -> list[str]:
    """Every reason a sample can be dropped for, in the order the checks run."""
    return [*cfg.filters, DUPLICATE, UNVERIFIABLE, INCORRECT, JUDGE_REJECTED, JUDGE_UNPARSEABLE,
            PER_PROMPT_CAP, DUPLICATE_ACROSS_SHARDS, CONTAMINATED, OVER_TARGET]


class Counts(NamedTuple):
    """What happened to the samples of a shard or a whole run: generated == kept + sum(dropped.values())."""

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

    @classmethod
    def zero(cls, cfg: RejectionConfig) -> "Counts":
        return cls(0, 0, dict.fromkeys(drop_reasons(cfg), 0), 0, 0, 0, 0, 0, 0, 0)

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Counts":
        return cls(**d)

    def plus(self, other: "Counts") -> "Counts":
        """Both counts summed, field by field (a shard's counts plus another's)."""
        dropped = dict(self.dropped)
        for reason, n in other.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + n
        summed = {k: a + b for (k, a), b in zip(self._asdict().items(), other) if k != "dropped"}
        return Counts(**summed, dropped=dropped)

    def metrics(self, prefix: str = "rejection/") -> dict[str, float]:
        """Flat figures for a metrics logger: rejection/generated, rejection/dropped/tags, ..."""
        out = {f"{prefix}{k}": float(v) for k, v in self._asdict().items() if k != "dropped"}
        out.update({f"{prefix}dropped/{k}": float(v) for k, v in self.dropped.items()})
        out[f"{prefix}keep_rate"] = self.kept / self.generated if self.generated else 0.0
        if self.both_checked:
            out[f"{prefix}judge_rule_agreement"] = self.agreed / self.both_checked
        return out


# ----------------------------------------------------------------------------------------------------------------
# Correctness: the rule check where there is a reference, a judge otherwise (or both)

def prompt_text(prompt: Any) -> str:
    """A prompt cell as plain text: a string as is, chat messages as their contents one per line."""
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "tolist"):  # Parquet hands back chat messages as numpy arrays
        prompt = prompt.tolist()
    return "\n".join(str(m.get("content", "")) for m in prompt)


def reference_answer(value: Any) -> str | None:
    """An `answer` cell as the reference text, or None when the row has none (missing, NaN, blank)."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    text = str(value).strip()
    return text or None


# ----------------------------------------------------------------------------------------------------------------
# Dedupe and decontamination

def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def duplicate_mask(rows: pd.DataFrame) -> list[bool]:
    """True for each row whose (prompt, response), case and whitespace aside, repeats an earlier row's."""
    seen: set[tuple[str, str]] = set()
    mask = []
    for prompt, response in zip(rows["prompt"], rows["response"]):
        key = (_normalise(prompt_text(prompt)), _normalise(response))
        mask.append(key in seen)
        seen.add(key)
    return mask


def dedupe(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows without repeats of an earlier row's normalised (prompt, response); the first one stays."""
    return rows[np.array([not d for d in duplicate_mask(rows)], dtype=bool)]  # a bool array: [] would pick columns


_WORD = re.compile(r"\w+")


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def contamination_mask(texts: Sequence[str], heldout_prompts: Sequence[Any], n: int = 8,
                       threshold: float = 0.8) -> list[bool]:
    """True for each text that holds at least `threshold` of some held-out prompt's word n-grams.

    A share rather than any overlap: problems written from one template share their fixed wording (in the tiny
    task "hens lay no eggs how many hens lay" is in every farm problem), while a copied problem shares nearly all
    its n-grams, even under another name. A held-out prompt shorter than n words must appear whole.
    """
    index: dict[tuple[str, ...], list[int]] = defaultdict(list)  # n-gram -> held-out prompts that have it
    sizes: list[int] = []  # distinct n-grams per held-out prompt
    short: list[str] = []  # held-out prompts of fewer than n words, as " word word "
    for j, prompt in enumerate(heldout_prompts):
        words = _WORD.findall(prompt_text(prompt).lower())
        grams = _ngrams(words, n)
        sizes.append(len(grams))
        for gram in grams:
            index[gram].append(j)
        if 0 < len(words) < n:
            short.append(f" {' '.join(words)} ")
    mask = []
    for text in texts:
        words = _WORD.findall(text.lower())
        hits: Counter[int] = Counter()
        for gram in _ngrams(words, n):
            hits.update(index.get(gram, ()))
        contaminated = any(k >= threshold * sizes[j] for j, k in hits.items())
        if not contaminated and short:
            joined = f" {' '.join(words)} "
            contaminated = any(s in joined for s in short)
        mask.append(contaminated)
    return mask


def decontaminate(rows: pd.DataFrame, heldout_prompts: Sequence[Any], n: int = 8,
                  threshold: float = 0.8) -> pd.DataFrame:
    """The rows whose prompt + response do not copy a held-out prompt (see `contamination_mask`)."""
    texts = [f"{prompt_text(p)}\n{r}" for p, r in zip(rows["prompt"], rows["response"])]
    return rows[np.array([not c for c in contamination_mask(texts, heldout_prompts, n, threshold)], dtype=bool)]


# ----------------------------------------------------------------------------------------------------------------
# Curating one shard's samples

KEPT_COLUMNS = ["prompt", "response", "answer", "source_prompt_id", "sample_index", "completion_tokens",
                "verdict_source", "judge_accepted", "judge_rationale"]


class ShardResult(NamedTuple):
    """One shard after curation."""

    kept: pd.DataFrame  # the rows kept, KEPT_COLUMNS (completion_tokens only when the samples had it)
    samples: pd.DataFrame | None  # every sample with drop_reason ("" when kept) and verdicts; None when read back
    counts: Counts


def curate(samples: pd.DataFrame, cfg: RejectionConfig, judge: Judge | None = None) -> ShardResult:
    """Filter, dedupe and check already generated samples; the part of `process_shard` after generation.

    `samples` columns: prompt, response, source_prompt_id, sample_index; optional answer (the reference, None
    where a row has none), truncated (bool) and completion_tokens.
    """
    missing = [c for c in ("prompt", "response", "source_prompt_id", "sample_index") if c not in samples.columns]
    if missing:
        raise DataError(f"samples: missing column(s) {missing}; found {list(samples.columns)}")
    df = samples.reset_index(drop=True).copy()
    df = df.sort_values(["source_prompt_id", "sample_index"], kind="stable").reset_index(drop=True)
    n = len(df)
    responses = [str(r) for r in df["response"]]
    answers = [reference_answer(a) for a in df["answer"]] if "answer" in df.columns else [None] * n
    truncated = sum(bool(t) for t in df["truncated"]) if "truncated" in df.columns else 0
    reason: list[str] = [first_failed_filter(r, cfg) or "" for r in responses]

    if cfg.dedupe:
        alive = [i for i in range(n) if not reason[i]]
        for i, dup in zip(alive, duplicate_mask(df.iloc[alive])):
            if dup:
                reason[i] = DUPLICATE

    # the rule check, on every surviving sample that has a reference
    alive = [i for i in range(n) if not reason[i]]
    rule: dict[int, bool | None] = {}
    with_reference = [i for i in alive if answers[i] is not None]
    if with_reference:
        scores = accuracy_reward([responses[i] for i in with_reference], [answers[i] for i in with_reference])
        rule = {i: None if s is None else s == 1.0 for i, s in zip(with_reference, scores)}  # None: bad reference

    # the judge: where the rule has no verdict, or everywhere with judge_when="always"
    ask = [] if cfg.judge_when == "never" else [
        i for i in alive if cfg.judge_when == "always" or rule.get(i) is None]
    verdicts: dict[int, Verdict] = {}
    if ask:
        if judge is None:
            raise ValueError(f"{len(ask)} samples need a judge (judge_when={cfg.judge_when!r}) but none was given")
        answered = judge.judge_many([(prompt_text(df.at[i, "prompt"]), responses[i], answers[i]) for i in ask])
        if len(answered) != len(ask):
            raise ValueError(f"the judge returned {len(answered)} verdicts for {len(ask)} items")
        verdicts = dict(zip(ask, answered))

    source, judge_accepted, rationale = [""] * n, [None] * n, [""] * n
    for i in alive:
        r, v = rule.get(i), verdicts.get(i)
        if v is not None:
            judge_accepted[i], rationale[i] = v.accepted, v.rationale
        if r is not None:  # the rule decides wherever it can: it is exact, the judge is a model
            source[i], reason[i] = "rule", "" if r else INCORRECT
        elif v is None:
            reason[i] = UNVERIFIABLE
        elif v.accepted is None:
            reason[i] = JUDGE_UNPARSEABLE
        else:
            source[i], reason[i] = "judge", "" if v.accepted else JUDGE_REJECTED

    if cfg.max_kept_per_prompt:
        per_prompt: Counter[Any] = Counter()
        for i in range(n):  # sorted by sample_index within a prompt: the earliest correct samples stay
            if not reason[i]:
                pid = df.at[i, "source_prompt_id"]
                per_prompt[pid] += 1
                if per_prompt[pid] > cfg.max_kept_per_prompt:
                    reason[i] = PER_PROMPT_CAP

    df["answer"] = answers
    df["drop_reason"], df["verdict_source"] = reason, source
    df["rule_correct"] = [rule.get(i) for i in range(n)]
    df["judge_accepted"], df["judge_rationale"] = judge_accepted, rationale
    kept = df.loc[[not r for r in reason], [c for c in KEPT_COLUMNS if c in df.columns]].reset_index(drop=True)

    dropped = dict.fromkeys(drop_reasons(cfg), 0)
    dropped.update(Counter(r for r in reason if r))
    judged = list(verdicts.values())
    both = [i for i in alive if rule.get(i) is not None and i in verdicts and verdicts[i].accepted is not None]
    counts = Counts(
        generated=n, kept=len(kept), dropped=dropped, truncated=truncated,
        rule_checked=sum(v is not None for v in rule.values()),
        judge_asked=len(judged),
        judge_accepted=sum(v.accepted is True for v in judged),
        judge_unparseable=sum(v.accepted is None for v in judged),
        both_checked=len(both),
        agreed=sum(rule[i] == verdicts[i].accepted for i in both),
    )
    return ShardResult(kept, df, counts)


# ----------------------------------------------------------------------------------------------------------------
# Sampling one shard

class Shard(NamedTuple):
    index: int  # shard number, also in its file name
    start: int  # first prompt (position in the prompt table)
    stop: int  # one past the last prompt


def plan_shards(prompts_df: pd.DataFrame, cfg: RejectionConfig) -> list[Shard]:
    """Consecutive runs of `shard_size` prompts: the same prompt table and shard size always give the same plan."""
    n = len(prompts_df)
    return [Shard(i, start, min(start + cfg.shard_size, n)) for i, start in enumerate(range(0, n, cfg.shard_size))]


def rows_of_shard(prompts_df: pd.DataFrame, shard: Shard) -> pd.DataFrame:
    """The shard's prompt rows, with `source_prompt_id` = position in the whole prompt table."""
    rows = prompts_df.iloc[shard.start:shard.stop].copy()
    rows["source_prompt_id"] = range(shard.start, shard.stop)
    return rows


def shard_seed(seed: int, shard_index: int) -> int:
    """A sampling seed per shard, independent of which shards ran before it in this process."""
    digest = hashlib.sha256(f"rejection-{seed}-{shard_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**63


# torch's RNG is process-wide: shards sampled from several threads (Prefect's default task runner) take turns,
# or one shard's draws would interleave with another's and neither would be reproducible.
_RNG_LOCK = threading.Lock()


@contextlib.contextmanager
def seeded_torch(seed: int) -> Iterator[None]:
    """Run the body under torch.manual_seed(seed) and give the caller its RNG state back afterwards."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with _RNG_LOCK, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def process_shard(backend: GenerationBackend, shard_rows: pd.DataFrame, cfg: RejectionConfig,
                  judge: Judge | None, shard_index: int) -> ShardResult:
    """Sample `samples_per_prompt` completions for each prompt of the shard and curate them.

    Deterministic given (cfg, shard_rows, shard_index) for a backend that samples with torch's RNG (the
    transformers backend does; a vLLM backend must take the seed itself). `source_prompt_id` comes from that
    column (see `rows_of_shard`), else from the rows' index.
    """
    rows = validate_prompts(shard_rows, cfg, judge, source=f"shard {shard_index}")
    prompt_ids = rows["source_prompt_id"].tolist() if "source_prompt_id" in rows.columns else rows.index.tolist()
    with seeded_torch(shard_seed(cfg.seed, shard_index)):
        rollout = backend.generate(rows["prompt"].tolist(), cfg.samples_per_prompt, cfg.sampling)
    k = cfg.samples_per_prompt  # the rollout is laid out prompt by prompt, k rows each

    def repeat(values: list) -> list:
        return [v for v in values for _ in range(k)]

    samples = pd.DataFrame({
        "prompt": repeat(rows["prompt"].tolist()),
        "answer": repeat(rows["answer"].tolist() if "answer" in rows.columns else [None] * len(rows)),
        "source_prompt_id": repeat(prompt_ids),
        "sample_index": list(range(k)) * len(rows),
        "response": rollout.texts,
        "truncated": rollout.truncated.tolist(),
        "completion_tokens": rollout.completion_mask.sum(-1).tolist(),
    })
    return curate(samples, cfg, judge)


def validate_prompts(prompts_df: pd.DataFrame, cfg: RejectionConfig, judge: Judge | None,
                     source: str = "prompts") -> pd.DataFrame:
    """Check the prompt table before any sampling; return it with answers as text or None.

    A row without an `answer` can only be checked by the judge: with no judge and judge_when != "never" that is
    an error here, not an hour of sampling thrown away later.
    """
    validate_rows(prompts_df, {"prompt": "text or chat messages"}, source)
    if cfg.judge_when == "always" and judge is None:
        raise ValueError("judge_when='always' asks the judge about every sample, but no judge was given")
    rows = prompts_df.copy()
    rows["prompt"] = [p.tolist() if hasattr(p, "tolist") else p for p in rows["prompt"]]
    answers = [reference_answer(a) for a in rows["answer"]] if "answer" in rows.columns else [None] * len(rows)
    if "answer" in rows.columns:
        rows["answer"] = pd.Series(answers, index=rows.index, dtype=object)  # None, not a string dtype's NaN
    no_answer = [i for i, a in enumerate(answers) if a is None]
    if no_answer and judge is None and cfg.judge_when != "never":
        where = "has no 'answer' column" if "answer" not in rows.columns else (
            f"row {no_answer[0]}, column 'answer': empty ({len(no_answer)} rows have no answer)")
        raise DataError(f"{source}: {where}; a row without a reference answer needs a judge: pass judge=..., "
                        f"or set judge_when='never' to drop such rows")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Shard files: shard-00003.parquet (kept rows, counts in its metadata) and shard-00003.json (the counts)

COUNTS_KEY = b"r1.rejection.counts"


def shard_path(out_dir: str | Path, index: int) -> Path:
    return Path(out_dir) / f"shard-{index:05d}.parquet"


def shard_done(out_dir: str | Path, index: int) -> bool:
    """True when the shard's Parquet file exists; it is only ever renamed into place whole."""
    return shard_path(out_dir, index).is_file()


def _write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`: readers see all or nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_shard(result: ShardResult, out_dir: str | Path, index: int) -> Path:
    """Write the shard's kept rows and counts; the Parquet rename comes last, so a present shard is a whole one."""
    path = shard_path(out_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = json.dumps(result.counts.to_dict())
    _write_atomically(path.with_suffix(".json"), lambda f: f.write(counts.encode()))
    table = pa.Table.from_pandas(result.kept, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), COUNTS_KEY: counts.encode()})
    _write_atomically(path, lambda f: pq.write_table(table, f))
    return path


def read_shard(out_dir: str | Path, index: int) -> ShardResult:
    """A written shard's kept rows and counts (the counts from the Parquet metadata, which always has them)."""
    table = pq.read_table(shard_path(out_dir, index))
    counts = Counts.from_dict(json.loads(table.schema.metadata[COUNTS_KEY]))
    kept = table.to_pandas()
    kept["prompt"] = [p.tolist() if hasattr(p, "tolist") else p for p in kept["prompt"]]
    return ShardResult(kept, None, counts)


# ----------------------------------------------------------------------------------------------------------------
# Merging shards into the dataset

class RejectionResult(NamedTuple):
    dataset: pd.DataFrame  # reasoning rows (KEPT_COLUMNS) then non-reasoning rows; `kind` says which
    counts: Counts  # the reasoning samples, through the merge: generated == kept + sum(dropped)
    non_reasoning: int  # non-reasoning rows appended


def _stable_hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("-".join(map(str, parts)).encode()).digest()[:8], "big")


def cap_rows(rows: pd.DataFrame, limit: int, seed: int) -> pd.DataFrame:
    """At most `limit` rows, covering prompts first: every prompt's first kept row before any prompt's second.

    Ties are broken by a hash of (seed, prompt id, sample index), so the pick depends on the rows alone, not on
    the order shards finished in. `rows` must be sorted by (source_prompt_id, sample_index).
    """
    if len(rows) <= limit:
        return rows
    rank = rows.groupby("source_prompt_id", sort=False).cumcount().tolist()
    ties = [_stable_hash(seed, p, s) for p, s in zip(rows["source_prompt_id"], rows["sample_index"])]
    chosen = sorted(sorted(range(len(rows)), key=lambda i: (rank[i], ties[i]))[:limit])
    return rows.iloc[chosen]


def merge_shards(out_dir: str | Path, cfg: RejectionConfig, heldout: pd.DataFrame | Sequence[Any] | None = None,
                 non_reasoning: pd.DataFrame | None = None, num_shards: int | None = None) -> RejectionResult:
    """The final dataset from the written shards: dedupe across shards, decontaminate, cap, add non-reasoning rows.

    `num_shards`: the planned count; any missing shard is then an error. Without it, every shard file is read.
    `heldout`: held-out prompts (a table with a `prompt` column, or the prompts themselves).
    """
    out_dir = Path(out_dir)
    if num_shards is None:
        indices = sorted(int(p.stem.split("-")[1]) for p in out_dir.glob("shard-*.parquet"))
    else:
        indices = list(range(num_shards))
        missing = [i for i in indices if not shard_done(out_dir, i)]
        if missing:
            raise FileNotFoundError(f"{out_dir}: shard(s) {missing} not written yet; run them before merging")
    shards = [read_shard(out_dir, i) for i in indices]
    counts = Counts.zero(cfg)
    for shard in shards:
        counts = counts.plus(shard.counts)
    frames = [s.kept for s in shards if len(s.kept)]
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=KEPT_COLUMNS)
    rows = rows.sort_values(["source_prompt_id", "sample_index"], kind="stable").reset_index(drop=True)

    dropped = dict(counts.dropped)
    before = len(rows)
    if cfg.dedupe:
        rows = dedupe(rows)
    dropped[DUPLICATE_ACROSS_SHARDS] += before - len(rows)
    before = len(rows)
    if heldout is not None and cfg.decontamination_ngram:
        prompts = heldout["prompt"].tolist() if isinstance(heldout, pd.DataFrame) else list(heldout)
        rows = decontaminate(rows, prompts, cfg.decontamination_ngram, cfg.decontamination_threshold)
    dropped[CONTAMINATED] += before - len(rows)
    before = len(rows)
    rows = cap_rows(rows.reset_index(drop=True), cfg.target_samples - cfg.non_reasoning_rows, cfg.seed)
    dropped[OVER_TARGET] += before - len(rows)
    rows = rows.reset_index(drop=True).assign(kind="reasoning")
    counts = counts._replace(kept=len(rows), dropped=dropped)

    extra = pd.DataFrame(columns=["prompt", "response"])
    if non_reasoning is not None and cfg.non_reasoning_rows:
        extra = non_reasoning.head(cfg.non_reasoning_rows)[["prompt", "response"]]
    dataset = pd.concat([rows, extra.assign(kind="non_reasoning")], ignore_index=True) if len(extra) else rows
    return RejectionResult(dataset, counts, len(extra))


# ----------------------------------------------------------------------------------------------------------------
# The whole stage without Prefect

MANIFEST = "manifest.json"


def _manifest(prompts: pd.DataFrame, cfg: RejectionConfig) -> dict[str, Any]:
    """What the shards depend on: the prompt table and every config field but the merge-only ones."""
    table = json.dumps([[prompt_text(p), a] for p, a in zip(
        prompts["prompt"], prompts["answer"] if "answer" in prompts.columns else [None] * len(prompts))])
    return {"prompts_sha256": hashlib.sha256(table.encode()).hexdigest(), "num_prompts": len(prompts),
            "config": cfg.model_dump(mode="json", exclude=set(MERGE_ONLY_FIELDS))}


def check_manifest(out_dir: Path, prompts: pd.DataFrame, cfg: RejectionConfig) -> None:
    """Record what the shards in `out_dir` are made from, or refuse to mix in shards made from something else."""
    want = _manifest(prompts, cfg)
    path = out_dir / MANIFEST
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, lambda f: f.write(json.dumps(want, indent=1).encode()))
        return
    have = json.loads(path.read_text())
    if have != want:
        changed = [k for k in ("prompts_sha256", "num_prompts") if have.get(k) != want[k]]
        changed += [f"config.{k}" for k in want["config"] if have.get("config", {}).get(k) != want["config"][k]]
        raise ValueError(f"{out_dir} holds shards made from other inputs (changed: {', '.join(changed)}); "
                         f"use a new folder, or delete the old shards and {MANIFEST}")


def run_rejection_sampling(backend: GenerationBackend, prompts_df: pd.DataFrame, cfg: RejectionConfig,
                           out_dir: str | Path, judge: Judge | None = None,
                           heldout: pd.DataFrame | Sequence[Any] | None = None,
                           non_reasoning: pd.DataFrame | None = None, progress: bool = True,
                           on_shard: Callable[[int, Counts], None] | None = None) -> RejectionResult:
    """Sample every shard not yet written to `out_dir`, then merge all of them into the dataset.

    Everything is checked before sampling starts. `on_shard(index, counts)` is called after each shard written.
    """
    prompts = validate_prompts(prompts_df.reset_index(drop=True), cfg, judge)
    if cfg.non_reasoning_rows:
        if non_reasoning is None:
            raise ValueError(f"non_reasoning_rows={cfg.non_reasoning_rows} but no non-reasoning rows were given")
        validate_rows(non_reasoning, {"prompt": "text or chat messages", "response": "text"}, "non_reasoning")
        if len(non_reasoning) < cfg.non_reasoning_rows:
            raise DataError(f"non_reasoning: {len(non_reasoning)} rows, the config asks for {cfg.non_reasoning_rows}")
    if isinstance(heldout, pd.DataFrame):
        validate_rows(heldout, {"prompt": "text or chat messages"}, "heldout")
    out_dir = Path(out_dir)
    check_manifest(out_dir, prompts, cfg)
    shards = plan_shards(prompts, cfg)
    todo = [s for s in shards if not shard_done(out_dir, s.index)]
    bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc="rejection sampling", disable=not progress)
    kept = 0
    for shard in todo:
        result = process_shard(backend, rows_of_shard(prompts, shard), cfg, judge, shard.index)
        write_shard(result, out_dir, shard.index)
        kept += result.counts.kept
        bar.update(1)
        bar.set_postfix(kept_this_run=kept)
        if on_shard:
            on_shard(shard.index, result.counts)
    bar.close()
    return merge_shards(out_dir, cfg, heldout, non_reasoning, num_shards=len(shards))
