"""Curation of one shard's samples: readability, duplicates, correctness (rule check, judge or both), the per-prompt
cap; and, across shards, dedupe and decontamination against the held-out split.

Must not depend on Prefect or MLflow; the judge comes in as an object with the `Judge` interface.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter
from typing import Any, NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from grpo.configs.rejection import RejectionConfig
from grpo.data.tables import DataError
from grpo.rejection.budget import ShardTiming
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


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


# Word n-grams are compared as 64-bit hashes: each word hashed once (pandas' siphash, the same in every process),
# a window's hash a polynomial of its words' (mod 2**64) put through splitmix64's finaliser, all windows of a batch
# of rows at once in numpy. Two different n-grams share a hash with odds of about 2**-64 a pair.
_FOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves every output bit."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


class _Units(NamedTuple):
    """Word sequences laid end to end: unit u's word hashes are hashes[bounds[u]:bounds[u + 1]]."""

    hashes: np.ndarray  # [W] uint64
    bounds: np.ndarray  # [U + 1] int64


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The positions starts[i] .. starts[i] + lengths[i] - 1, for every i in turn [sum(lengths)] int64."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - ends + lengths, lengths) + np.arange(ends[-1] if len(ends) else 0)


def _hash_words(words: np.ndarray) -> np.ndarray:
    return pd.util.hash_array(words) if len(words) else np.zeros(0, dtype=np.uint64)


# On ASCII text `_words` is: lower-case A-Z, then the runs of [a-z0-9_]. One byte table does both, every other byte
# becoming a space, and Arrow splits, numbers and so hashes each distinct word once, with no Python object per word.
_ASCII_WORDS = bytes(c + 32 if 65 <= c <= 90 else c if 97 <= c <= 122 or 48 <= c <= 57 or c == 95 else 32
                     for c in range(256))


def _word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each text's `_words`, hashed: (every text's word hashes end to end [W] uint64, words per text [T] int64).

    ASCII texts (most reasoning traces) through a byte table and Arrow's kernels, others through Python's own
    `lower` and `\\w`; the words are the same either way.
    """
    ascii = np.fromiter((t.isascii() for t in texts), dtype=bool, count=len(texts))  # [T]
    counts = np.zeros(len(texts), dtype=np.int64)
    parts = []  # (which texts, their word hashes end to end)
    if ascii.any():
        rows = np.flatnonzero(ascii)
        mapped = pa.array([texts[i].encode().translate(_ASCII_WORDS) for i in rows], pa.large_binary())
        split = pc.ascii_split_whitespace(mapped.cast(pa.large_string()))
        flat, parent = pc.list_flatten(split), pc.list_parent_indices(split)
        word = pc.greater(pc.binary_length(flat), 0)
        flat, parent = flat.filter(word), parent.filter(word).to_numpy()
        coded = pc.dictionary_encode(flat)  # each distinct word hashed once
        hashes = _hash_words(coded.dictionary.to_numpy(zero_copy_only=False))[coded.indices.to_numpy()]
        counts[rows] = np.bincount(parent, minlength=len(rows))
        parts.append((rows, hashes))
    if not ascii.all():
        rows = np.flatnonzero(~ascii)
        words = [_words(texts[i]) for i in rows]
        counts[rows] = [len(w) for w in words]
        total = int(counts[rows].sum())
        parts.append((rows, _hash_words(np.fromiter(itertools.chain.from_iterable(words), object, total))))
    offsets = np.cumsum(counts) - counts  # [T] where each text's words go
    out = np.zeros(int(counts.sum()), dtype=np.uint64)
    for rows, hashes in parts:
        out[_ranges(offsets[rows], counts[rows])] = hashes
    return out, counts


def _units(counts: np.ndarray, hashes: np.ndarray) -> _Units:
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return _Units(hashes, bounds)


def _grams(units: _Units, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every run of n consecutive words inside one unit: (its unit [G] int64, its hash [G] uint64)."""
    w, bounds = units
    count = max(len(w) - n + 1, 0)
    unit = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))[:count]  # [count] the unit each word is in
    inside = np.arange(count) + n <= bounds[unit + 1]  # a window that runs into the next unit is no n-gram of either
    h = w[:count].copy()
    for k in range(1, n):
        h *= _FOLD
        h += w[k:k + count]
    return unit[inside], _mix(h[inside])


_SEEN = 2**20  # slots of HeldoutIndex.seen


class HeldoutIndex(NamedTuple):
    """The held-out prompts' word n-grams as sorted 64-bit hashes: built once, then checked against any number of
    rows without a Python loop over n-grams."""

    n: int
    threshold: float
    keys: np.ndarray  # [K] uint64, sorted: one n-gram hash per (n-gram, held-out prompt that has it)
    owners: np.ndarray  # [K] int64: the held-out prompt of each key
    need: np.ndarray  # [H] float64: threshold x the prompt's distinct n-grams, the hits that mark a row
    short: dict[int, np.ndarray]  # m -> sorted uint64 hashes of the held-out prompts of m words, 0 < m < n
    seen: np.ndarray  # [2**20] bool: some key has these low 20 bits; most grams are ruled out with one lookup
    digest: str  # sha256 of (n, threshold, the prompts' texts): a shard's flags are reused only for the same index


def build_heldout_index(heldout_prompts: Sequence[Any], n: int = 8, threshold: float = 0.8) -> HeldoutIndex:
    """Hash the held-out prompts' word n-grams once (see `contamination_mask` for the rule)."""
    texts = [prompt_text(p) for p in heldout_prompts]
    hashes, counts = _word_hashes(texts)
    units = _units(counts, hashes)
    owner, h = _grams(units, n)
    order = np.lexsort((owner, h))
    owner, h = owner[order], h[order]
    first = np.ones(len(h), dtype=bool)
    first[1:] = (h[1:] != h[:-1]) | (owner[1:] != owner[:-1])  # an n-gram twice in one prompt counts once
    owner, h = owner[first], h[first]
    sizes = np.bincount(owner, minlength=len(texts))  # [H] distinct n-grams per held-out prompt
    short: dict[int, np.ndarray] = {}
    for m in sorted({int(c) for c in counts if 0 < c < n}):
        unit, whole = _grams(units, m)
        short[m] = np.unique(whole[counts[unit] == m])  # the one m-gram of each m-word prompt
    digest = hashlib.sha256(json.dumps([n, threshold, texts]).encode()).hexdigest()
    seen = np.zeros(_SEEN, dtype=bool)
    seen[(h & np.uint64(_SEEN - 1)).astype(np.intp)] = True
    return HeldoutIndex(n, threshold, h, owner, threshold * sizes.astype(np.float64), short, seen, digest)


def _owners_of(index: HeldoutIndex, grams: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each gram, every held-out prompt that has it: (position in `grams` [P], held-out prompt [P])."""
    left = np.searchsorted(index.keys, grams, side="left")
    count = np.searchsorted(index.keys, grams, side="right") - left
    at = np.repeat(np.arange(len(grams)), count)
    offset = np.arange(len(at)) - np.repeat(np.cumsum(count) - count, count)
    return at, index.owners[np.repeat(left, count) + offset]


def _in_index(index: HeldoutIndex, grams: np.ndarray) -> np.ndarray:
    """[G] bool: the gram is one of the index's keys."""
    found = index.seen[(grams & np.uint64(_SEEN - 1)).astype(np.intp)]
    found[found] = _in_sorted(index.keys, grams[found])
    return found


def _in_sorted(sorted_keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    pos = np.minimum(np.searchsorted(sorted_keys, values), max(len(sorted_keys) - 1, 0))
    return sorted_keys[pos] == values if len(sorted_keys) else np.zeros(len(values), dtype=bool)


def contaminated(prompts: Sequence[Any], responses: Sequence[str], index: HeldoutIndex) -> np.ndarray:
    """True for each row whose prompt + response copies a held-out prompt: `contamination_mask`'s rule on
    `prompt_text(prompt) + "\\n" + response`, with each distinct prompt tokenised and looked up once.

    A row's n-grams are its prompt's, its response's and the n - 1 that straddle the two: the prompt's are counted
    per distinct prompt, and a row only adds the response's matches its prompt does not already have.
    """
    rows = len(responses)
    responses = [str(r) for r in responses]
    distinct: dict[str, int] = {}
    which = np.fromiter((distinct.setdefault(prompt_text(p), len(distinct)) for p in prompts), np.int64, rows)
    marked = np.zeros(rows, dtype=bool)  # [R]
    if not rows or (not len(index.keys) and not index.short):
        return marked
    p_hashes, p_counts = _word_hashes(list(distinct))
    r_hashes, r_counts = _word_hashes(responses)
    # a row's unit: its prompt's last n - 1 words (the ones a straddling n-gram takes), then its response's words
    tails = np.minimum(p_counts, index.n - 1)[which]  # [R]
    tail_starts = np.cumsum(p_counts)[which] - tails  # [R] in the distinct prompts' hashes
    r_starts = len(p_hashes) + np.cumsum(r_counts) - r_counts
    gather = _ranges(np.stack([tail_starts, r_starts], 1).ravel(), np.stack([tails, r_counts], 1).ravel())
    source = np.concatenate([p_hashes, r_hashes])
    units = _units(np.concatenate([p_counts, tails + r_counts]), np.concatenate([p_hashes, source[gather]]))
    p = len(p_counts)  # units 0..p-1: the distinct prompts; p..p+R-1: the rows

    # held-out prompts shorter than n words: contained whole, in the prompt or in the row
    for m, whole in index.short.items():
        unit, h = _grams(units, m)
        hit = np.unique(unit[_in_sorted(whole, h)])
        marked[np.isin(which, hit[hit < p])] = True
        marked[hit[hit >= p] - p] = True

    if len(index.keys):
        unit, h = _grams(units, index.n)
        found = _in_index(index, h)
        unit, h = unit[found], h[found]
        # the distinct prompts' hits on each held-out prompt, counted once per prompt
        is_prompt = unit < p
        pk, ph = unit[is_prompt], h[is_prompt]
        pairs = pd.MultiIndex.from_arrays([pk, ph]).unique()
        pk, ph = pairs.get_level_values(0).to_numpy(np.int64), pairs.get_level_values(1).to_numpy(np.uint64)
        at, owner = _owners_of(index, ph)
        base = pd.Series(1, index=pd.MultiIndex.from_arrays([pk[at], owner])).groupby(level=[0, 1]).sum()
        prompt_marked = np.zeros(p, dtype=bool)  # [P]
        if len(base):
            bk, bo = base.index.get_level_values(0).to_numpy(), base.index.get_level_values(1).to_numpy()
            prompt_marked[bk[base.to_numpy() >= index.need[bo]]] = True
        marked |= prompt_marked[which]

        # each row's response-side matches its prompt does not have, added to the prompt's hits
        row, rh = unit[~is_prompt] - p, h[~is_prompt]
        pairs = pd.MultiIndex.from_arrays([row, rh]).unique()
        row, rh = pairs.get_level_values(0).to_numpy(np.int64), pairs.get_level_values(1).to_numpy(np.uint64)
        new = ~pd.MultiIndex.from_arrays([which[row], rh]).isin(pd.MultiIndex.from_arrays([pk, ph]))
        row, rh = row[new], rh[new]
        at, owner = _owners_of(index, rh)
        extra = pd.Series(1, index=pd.MultiIndex.from_arrays([row[at], owner])).groupby(level=[0, 1]).sum()
        if len(extra):
            er, eo = extra.index.get_level_values(0).to_numpy(), extra.index.get_level_values(1).to_numpy()
            had = base.reindex(pd.MultiIndex.from_arrays([which[er], eo]), fill_value=0).to_numpy()
            marked[er[extra.to_numpy() + had >= index.need[eo]]] = True
    return marked


def contamination_mask(texts: Sequence[str], heldout_prompts: Sequence[Any], n: int = 8,
                       threshold: float = 0.8) -> list[bool]:
    """True for each text that holds at least `threshold` of some held-out prompt's word n-grams.

    A share rather than any overlap: problems written from one template share their fixed wording (in the tiny
    task "hens lay no eggs how many hens lay" is in every farm problem), while a copied problem shares nearly all
    its n-grams, even under another name. A held-out prompt shorter than n words must appear whole. Words are
    `\\w+` runs of the lower-cased text; a prompt's n-grams are counted once however often they occur.
    """
    return contaminated([""] * len(texts), texts, build_heldout_index(heldout_prompts, n, threshold)).tolist()


def decontaminate(rows: pd.DataFrame, heldout_prompts: Sequence[Any], n: int = 8,
                  threshold: float = 0.8) -> pd.DataFrame:
    """The rows whose prompt + response do not copy a held-out prompt (see `contamination_mask`)."""
    index = build_heldout_index(heldout_prompts, n, threshold)
    return rows[~contaminated(rows["prompt"].tolist(), rows["response"].tolist(), index)]


def row_keys(prompts: Sequence[Any], responses: Sequence[str]) -> np.ndarray:
    """A 64-bit hash of each row's normalised (prompt, response) [R] uint64: the cross-shard dedupe key.

    blake2b, so a key written in a shard today is the same key in another process, machine or library version;
    the prompt is length-prefixed, so no (prompt, response) split of one text matches another's.
    """
    out = np.empty(len(responses), dtype=np.uint64)
    seeded: dict[str, Any] = {}  # each distinct prompt normalised and hashed once
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        text = prompt_text(prompt)
        if text not in seeded:
            head = _normalise(text).encode()
            seeded[text] = hashlib.blake2b(len(head).to_bytes(8, "little") + head, digest_size=8)
        h = seeded[text].copy()
        h.update(_normalise(response).encode())
        out[i] = int.from_bytes(h.digest(), "little")
    return out


class ShardMarks(NamedTuple):
    """What the merge needs to know of a shard's kept rows, worked out where the shard was sampled."""

    row_key: np.ndarray  # [R] uint64: `row_keys`, the cross-shard dedupe key
    contaminated: np.ndarray | None  # [R] bool: `contaminated` against the index below; None without one
    heldout: str  # the HeldoutIndex digest the flags hold for; "" without one


def mark_rows(kept: pd.DataFrame, index: HeldoutIndex | None) -> ShardMarks:
    """The dedupe key of every kept row and, given the held-out index, whether it is contaminated."""
    prompts, responses = kept["prompt"].tolist(), [str(r) for r in kept["response"]]
    flags = contaminated(prompts, responses, index) if index is not None else None
    return ShardMarks(row_keys(prompts, responses), flags, index.digest if index is not None else "")


# ----------------------------------------------------------------------------------------------------------------
# Curating one shard's samples

KEPT_COLUMNS = ["prompt", "response", "answer", "source_prompt_id", "sample_index", "completion_tokens",
                "verdict_source", "judge_accepted", "judge_rationale"]


class ShardResult(NamedTuple):
    """One shard after curation."""

    kept: pd.DataFrame  # the rows kept, KEPT_COLUMNS (completion_tokens only when the samples had it)
    samples: pd.DataFrame | None  # every sample with drop_reason ("" when kept) and verdicts; None when read back
    counts: Counts
    marks: ShardMarks | None = None  # the merge's keys for `kept`, when the shard task worked them out
    timing: ShardTiming | None = None  # what the shard task measured, where it did (grpo.rejection.budget)


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
