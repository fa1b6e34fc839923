"""Curation of one shard's samples: readability, duplicates, correctness (rule check, judge or both), the per-prompt
cap; and, across shards, dedupe and decontamination against the held-out split.

Must not depend on Prefect or MLflow; the judge comes in as an object with the `Judge` interface.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any, NamedTuple, Sequence

import numpy as np
import pandas as pd

from grpo.configs.core import RejectionConfig
from grpo.data.tables import DataError
from grpo.rejection.filters import (
    DUPLICATE,
    INCORRECT,
    JUDGE_REJECTED,
    PER_PROMPT_CAP,
    UNGRADED,
    UNVERIFIABLE,
    Counts,
    drop_reasons,
    first_failed_filter,
)
from grpo.rewards.correct import CHECK_COLUMNS, check_rows
from grpo.sampling.judge import Judge, Verdict, verdict_ungraded

# ----------------------------------------------------------------------------------------------------------------
# Correctness: the rule check where there is a reference or tests, a judge otherwise (or both)

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
    where a row has none), tests / io_tests / setup / language (a code row's, grpo.rewards.code), truncated (bool)
    and completion_tokens. A row with tests is checked by them: a sample is correct when its program passes all.
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

    # the rule check, on every surviving sample: its tests where its row has them, else its reference answer
    # (the same check held-out evaluation uses); None where the row has neither, or a reference it cannot read
    alive = [i for i in range(n) if not reason[i]]
    rule: dict[int, bool | None] = {}
    rule_ungraded: dict[int, str] = {}  # why the rule could not say (a timeout, a sandbox failure)
    references = [""] * n  # what the judge is shown as the reference
    if alive:
        columns = {c: [df.at[i, c] for i in alive] for c in CHECK_COLUMNS if c in df.columns and c != "answer"}
        check = check_rows([responses[i] for i in alive], [answers[i] for i in alive], **columns,
                           code=cfg.code.model_dump())
        for j, i in enumerate(alive):
            if check.correct[j] is not None:
                rule[i] = check.correct[j]
            elif check.ungraded and check.ungraded[j]:
                rule_ungraded[i] = check.ungraded[j]
            # a code row has no reference answer: the judge, where asked, is given its tests' results instead
            references[i] = (f"(no reference answer: the program in the response passed {check.passed[j]} of "
                             f"its {check.total[j]} tests)" if check.by_tests[j] else answers[i])

    # the judge: where the rule has no verdict, or everywhere with judge_when="always", or also where the rule says
    # incorrect with judge_when="appeal"
    ask = [] if cfg.judge_when == "never" else [
        i for i in alive if cfg.judge_when == "always" or rule.get(i) is None
        or (cfg.judge_when == "appeal" and rule.get(i) is False)]
    verdicts: dict[int, Verdict] = {}
    if ask:
        if judge is None:
            raise ValueError(f"{len(ask)} samples need a judge (judge_when={cfg.judge_when!r}) but none was given")
        answered = judge.judge_many([(prompt_text(df.at[i, "prompt"]), responses[i], references[i]) for i in ask])
        if len(answered) != len(ask):
            raise ValueError(f"the judge returned {len(answered)} verdicts for {len(ask)} items")
        verdicts = dict(zip(ask, answered))

    source, judge_accepted, rationale = [""] * n, [None] * n, [""] * n
    ungraded: list[str] = [""] * n  # why a sample could not be graded: neither kept nor rejected
    for i in alive:
        r, v = rule.get(i), verdicts.get(i)
        if v is not None:
            judge_accepted[i], rationale[i] = v.accepted, v.rationale
        if r is False and cfg.judge_when == "appeal" and v is not None and v.accepted is True:
            source[i], reason[i] = "appeal", ""  # a right answer the rule could not read: the judge's yes keeps it
        elif r is not None:  # the rule decides wherever it can: it is exact, the judge is a model
            source[i], reason[i] = "rule", "" if r else INCORRECT
        elif v is not None and v.accepted is not None:
            source[i], reason[i] = "judge", "" if v.accepted else JUDGE_REJECTED
        elif v is not None or i in rule_ungraded:  # asked and could not say, or a rule check that could not
            reason[i], ungraded[i] = UNGRADED, rule_ungraded.get(i) or verdict_ungraded(v)
        else:
            reason[i] = UNVERIFIABLE

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
    df["ungraded"] = ungraded
    kept = df.loc[[not r for r in reason], [c for c in KEPT_COLUMNS if c in df.columns]].reset_index(drop=True)

    dropped = dict.fromkeys(drop_reasons(cfg), 0)
    dropped.update(Counter(r for r in reason if r and r != UNGRADED))
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
        ungraded=dict(Counter(why for why in ungraded if why)),
        appeal_upheld=sum(s == "appeal" for s in source),
    )
    return ShardResult(kept, df, counts)
