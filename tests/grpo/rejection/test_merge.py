"""Curation at scale: the hashed n-gram check against a plain reference, the shard task's marks, and the merge from
keys (in memory and streamed to Parquet) against today's merge written out naively here."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo.configs.data import TaskConfig
from grpo.configs.rejection import RejectionConfig
from grpo.data.arithmetic import generate_problems
from grpo.data.tables import DataError
from grpo.rejection.curate import (
    KEPT_COLUMNS,
    build_heldout_index,
    contaminated,
    contamination_mask,
    curate,
    decontaminate,
    mark_rows,
)
from grpo.rejection.merge import merge_shards, select_rows, write_merged
from grpo.rejection.store import read_shard, write_shard
from shard_files import CFG, HELDOUT, NON_REASONING, said, tiny_shards

# ----------------------------------------------------------------------------------------------------------------
# References: today's rules, written the plain way (tuples of words, Python loops, whole frames)


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def naive_contaminated(text: str, heldout: list[str], n: int, threshold: float) -> bool:
    """A held-out prompt with n-grams: at least `threshold` of its distinct n-grams in the text; one with
    fewer than n (but some) words: its words appear together, in order."""
    w = words(text)
    grams = {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
    for prompt in heldout:
        h = words(prompt)
        theirs = {tuple(h[i:i + n]) for i in range(len(h) - n + 1)}
        if theirs and len(grams & theirs) >= threshold * len(theirs):
            return True
        if 0 < len(h) < n and any(w[i:i + len(h)] == h for i in range(len(w) - len(h) + 1)):
            return True
    return False


def text_of(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def reference_merge(out_dir, indices, cfg: RejectionConfig, heldout: list[str], non_reasoning=None):
    """Today's merge: every shard in memory, sorted, deduped by normalised text, decontaminated, capped."""
    frames = []
    for i in indices:
        table = pq.read_table(out_dir / f"shard-{i:05d}.parquet")
        table = table.drop_columns([c for c in ("merge_key", "contaminated") if c in table.column_names])
        kept = table.to_pandas()
        kept["prompt"] = [p.tolist() if hasattr(p, "tolist") else p for p in kept["prompt"]]
        if len(kept):
            frames.append(kept)
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=KEPT_COLUMNS)
    rows = rows.sort_values(["source_prompt_id", "sample_index"], kind="stable").reset_index(drop=True)

    def norm(t: str) -> str:
        return " ".join(t.lower().split())

    seen, keep = set(), []
    for p, r in zip(rows["prompt"], rows["response"]):
        key = (norm(text_of(p)), norm(r))
        keep.append(not cfg.dedupe or key not in seen)
        seen.add(key)
    duplicates = keep.count(False)
    rows = rows[np.array(keep, dtype=bool)]
    clean = [not naive_contaminated(f"{text_of(p)}\n{r}", heldout, cfg.decontamination_ngram,
                                    cfg.decontamination_threshold) for p, r in zip(rows["prompt"], rows["response"])]
    copied = clean.count(False)
    rows = rows[np.array(clean, dtype=bool)].reset_index(drop=True)
    limit = cfg.target_samples - cfg.non_reasoning_rows
    over = max(len(rows) - limit, 0)
    if over:
        rank = rows.groupby("source_prompt_id", sort=False).cumcount().tolist()
        ties = [int.from_bytes(hashlib.sha256(f"{cfg.seed}-{p}-{s}".encode()).digest()[:8], "big")
                for p, s in zip(rows["source_prompt_id"], rows["sample_index"])]
        rows = rows.iloc[sorted(sorted(range(len(rows)), key=lambda i: (rank[i], ties[i]))[:limit])]
    rows = rows.reset_index(drop=True).assign(kind="reasoning")
    if non_reasoning is not None and cfg.non_reasoning_rows:
        extra = non_reasoning.head(cfg.non_reasoning_rows)[["prompt", "response"]]
        rows = pd.concat([rows, extra.assign(kind="non_reasoning")], ignore_index=True)
    return rows, {"duplicate_across_shards": duplicates, "contaminated": copied, "over_target": over}


# ----------------------------------------------------------------------------------------------------------------
# The hashed n-gram check

TRAIN = [p.question for p in generate_problems(TaskConfig(), 40, "train")]


def test_the_hashed_check_marks_exactly_the_rows_the_plain_rule_marks():
    a, b = HELDOUT[0], HELDOUT[1]
    aw = a.split()
    heldout = HELDOUT + ["Say hi now", "one two three four five six seven eight"]  # 3 words; exactly n words
    n, threshold = 8, 0.8
    size = len({tuple(words(a)[i:i + n]) for i in range(len(words(a)) - n + 1)})
    need = int(np.ceil(threshold * size))
    rows = [  # (prompt, response)
        (TRAIN[0], "<think>plain work</think><answer>3</answer>"),  # template wording only: clean
        (a, "<think>x</think>"),  # the prompt is a held-out one: contaminated on its own
        (a, "something else entirely"),  # the same prompt again (checked once, marked for both)
        (TRAIN[1], f"The problem: {b} So 5."),  # the response quotes one
        (" ".join(aw[:len(aw) // 2]), " ".join(aw[len(aw) // 2:])),  # a copy split across prompt and response
        ("Tell me: SAY hi", "now, please"),  # a short held-out prompt straddling the two
        ("Say", "hi"),  # part of it: clean
        ("", "one two three four five six seven"),  # seven of eight words: no 8-gram, clean
        ("", "one two three four five six seven eight"),  # the whole 8 words: its one n-gram
        ("a b", "c"),  # fewer than n words in all
        ("", ""),
        ([{"role": "user", "content": "Q:"}, {"role": "user", "content": a.upper()}], "ok"),  # chat, upper case
    ]
    # the threshold boundary: the first `need` distinct n-grams of `a` is exactly enough, one fewer is not
    w = words(a)
    for k in (need, need - 1):
        text = " ".join(w[:k + n - 1])  # k + n - 1 words hold k n-grams
        rows += [(TRAIN[2], text), (text, "")]
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    expected = [naive_contaminated(f"{text_of(p)}\n{r}", heldout, n, threshold) for p, r in rows]
    assert expected[:12] == [False, True, True, True, True, True, False, False, True, False, False, True]
    assert expected[12:] == [True, True, False, False]  # the boundary is inclusive
    index = build_heldout_index(heldout, n, threshold)
    assert contaminated(prompts, responses, index).tolist() == expected
    assert contamination_mask([f"{text_of(p)}\n{r}" for p, r in rows], heldout, n, threshold) == expected
    frame = pd.DataFrame({"prompt": prompts, "response": responses})
    assert decontaminate(frame, heldout, n, threshold).index.tolist() == [i for i, e in enumerate(expected) if not e]


@pytest.mark.parametrize("n, threshold", [(8, 0.8), (8, 0.5), (3, 1.0), (1, 0.3), (4, 0.75)])
def test_the_hashed_check_agrees_with_the_plain_rule_on_mixed_rows(n, threshold):
    """Random cuts of held-out and training problems: copies, partial copies, straddles, repeated prompts."""
    rng = np.random.default_rng(n * 100 + int(threshold * 10))
    heldout = HELDOUT[:20] + ["say hi", "", "Add 2 and 3"]
    rows = []
    for _ in range(300):
        source = (heldout if rng.random() < 0.5 else TRAIN)[rng.integers(20)].split()
        cut, stop = sorted(rng.integers(0, len(source) + 1, size=2))
        prompt = " ".join(source[:cut]) if rng.random() < 0.7 else TRAIN[rng.integers(3)]  # few distinct prompts
        rows.append((prompt, " ".join(source[cut:stop]) + " " + TRAIN[rng.integers(20)][:rng.integers(60)]))
    expected = [naive_contaminated(f"{p}\n{r}", heldout, n, threshold) for p, r in rows]
    assert 0 < sum(expected) < len(rows)
    got = contaminated([p for p, _ in rows], [r for _, r in rows], build_heldout_index(heldout, n, threshold))
    assert got.tolist() == expected


def test_no_heldout_prompts_mark_nothing():
    assert contamination_mask(["a b c d e f g h i"], [], 8, 0.8) == [False]
    assert contamination_mask([], HELDOUT, 8, 0.8) == []


# ----------------------------------------------------------------------------------------------------------------
# Shards like the tiny recipe's, and the merge against today's

@pytest.mark.parametrize("written", ["marked here", "unmarked", "marked for another held-out set"])
def test_the_merge_keeps_todays_rows_byte_for_byte(tmp_path, written):
    index = build_heldout_index(HELDOUT, CFG.decontamination_ngram, CFG.decontamination_threshold)
    other = build_heldout_index(HELDOUT[:3], CFG.decontamination_ngram, CFG.decontamination_threshold)
    shards = tiny_shards(tmp_path, index if written == "marked here" else other, marks=written != "unmarked")
    expected, dropped = reference_merge(tmp_path, shards, CFG, HELDOUT, NON_REASONING)
    # every rule has work to do on these shards
    assert dropped["duplicate_across_shards"] >= 6 and dropped["contaminated"] == 1 and dropped["over_target"] > 10
    kept = sum(read_shard(tmp_path, i).counts.kept for i in shards)
    assert kept > CFG.target_samples and len(expected) == CFG.target_samples

    result = merge_shards(tmp_path, CFG, heldout=pd.DataFrame({"prompt": HELDOUT}), non_reasoning=NON_REASONING,
                          num_shards=5)
    pd.testing.assert_frame_equal(result.dataset, expected, check_exact=True)
    assert {k: result.counts.dropped[k] for k in dropped} == dropped
    assert result.counts.kept == CFG.target_samples - CFG.non_reasoning_rows and result.non_reasoning == 5

    written_out = write_merged(tmp_path, CFG, tmp_path / "curated", HELDOUT, NON_REASONING, num_shards=5,
                               rows_per_file=40)
    assert [p.rsplit("/", 1)[1] for p in written_out.files] == [f"part-0000{i}.parquet" for i in range(4)]
    tables = [pq.read_table(p) for p in written_out.files]
    assert max(t.num_rows for t in tables) == 40
    assert all(pq.ParquetFile(p).metadata.row_group(g).num_rows <= 2 * CFG.merge_batch_rows
               for p in written_out.files for g in range(pq.ParquetFile(p).metadata.num_row_groups))
    back = pd.concat([t.to_pandas() for t in tables], ignore_index=True)
    assert written_out.rows == len(back) == len(expected) and written_out.counts == result.counts

    def cells(frame: pd.DataFrame) -> list[list]:  # NaN and None are both "no value" in either form
        return [[None if v is None or (isinstance(v, float) and v != v) else v for v in row]
                for row in frame[list(expected.columns)].astype(object).itertuples(index=False)]

    assert cells(back) == cells(expected)


def test_a_shard_tasks_flags_are_what_the_merge_uses(tmp_path):
    """A flag the shard task wrote against this held-out set is used as is (here a row flagged by hand is dropped);
    against another held-out set it is worked out again."""
    index = build_heldout_index(HELDOUT, 8, 0.8)
    frame = pd.DataFrame({"prompt": ["Q0", "Q1"], "answer": ["1", "2"],
                          "response": [said("1", "a"), said("2", "b")], "source_prompt_id": [0, 1],
                          "sample_index": [0, 0]})
    result = curate(frame, CFG)
    result = result._replace(kept=result.kept.assign(judge_accepted=[None, True]))  # a judge asked about one
    marks = mark_rows(result.kept, index)
    assert marks.contaminated.tolist() == [False, False]
    write_shard(result._replace(marks=marks._replace(contaminated=np.array([True, False]))), tmp_path, 0)
    back = read_shard(tmp_path, 0)
    assert list(back.kept.columns) == list(result.kept.columns) and back.marks.heldout == index.digest
    merged = merge_shards(tmp_path, CFG, HELDOUT).dataset
    assert merged["prompt"].tolist() == ["Q1"]
    # the column keeps the type the whole shard's column has (bool with a null: object), as when read whole
    assert merged["judge_accepted"].dtype == object and back.kept["judge_accepted"].dtype == object
    assert merge_shards(tmp_path, CFG, HELDOUT[:5]).dataset["prompt"].tolist() == ["Q0", "Q1"]
    assert merge_shards(tmp_path, CFG).dataset["prompt"].tolist() == ["Q0", "Q1"]  # no held-out set


def test_shards_out_of_prompt_order_merge_in_memory_but_do_not_stream(tmp_path):
    cfg = RejectionConfig(max_kept_per_prompt=0, target_samples=4, decontamination_ngram=0)
    for s, ids in enumerate([[2, 5], [1, 2]]):
        frame = pd.DataFrame({"prompt": [f"Q{i}" for i in ids], "answer": ["1", "1"],
                              "response": [said("1", f"shard {s}")] * 2, "source_prompt_id": ids,
                              "sample_index": [0, 0]})
        write_shard(curate(frame, cfg), tmp_path, s)
    expected, _ = reference_merge(tmp_path, [0, 1], cfg, [])
    result = merge_shards(tmp_path, cfg)
    pd.testing.assert_frame_equal(result.dataset, expected)
    assert result.dataset["source_prompt_id"].tolist() == [1, 2, 2, 5]
    with pytest.raises(DataError, match="not in \\(source_prompt_id, sample_index\\) order"):
        write_merged(tmp_path, cfg, tmp_path / "out")


def test_select_rows_by_hand():
    # prompt 0: rows 0, 1 (row 1 repeats row 0's key); prompt 1: rows 2, 3, 4 (row 3 contaminated)
    ids, samples = np.array([0, 0, 1, 1, 1]), np.array([0, 1, 0, 1, 2])
    keys = np.array([7, 7, 8, 9, 10], dtype=np.uint64)
    flags = np.array([False, False, False, True, False])
    sel = select_rows(ids, samples, keys, flags, dedupe=True, limit=2, seed=0)
    # survivors 0, 2, 4; ranks 0, 0, 1: the two first rows of their prompts fill the limit of 2
    assert sel.keep.tolist() == [True, False, True, False, False] and sel.in_order
    assert (sel.duplicates, sel.contaminated, sel.over_target) == (1, 1, 1)
    assert select_rows(ids, samples, keys, None, dedupe=False, limit=9, seed=0).keep.all()


def reference_select(ids, samples, keys, flags, dedupe: bool, limit: int, seed: int) -> list[int]:
    """The rows kept, in the dataset's order, the plain way: sort, first of each key, not flagged, then by (rank in
    its prompt, hash of (seed, prompt, sample), place) up to the limit."""
    rows = sorted(range(len(keys)), key=lambda i: (int(ids[i]), int(samples[i]), i))
    seen, survivors = set(), []
    for i in rows:
        if dedupe and int(keys[i]) in seen:
            continue
        seen.add(int(keys[i]))
        if flags is None or not flags[i]:
            survivors.append(i)
    rank, ranks = {}, []
    for i in survivors:
        ranks.append(rank.get(int(ids[i]), 0))
        rank[int(ids[i])] = ranks[-1] + 1

    def tie(i):
        text = "-".join(map(str, (seed, int(ids[i]), int(samples[i])))).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:8], "big")

    chosen = set(sorted(range(len(survivors)), key=lambda k: (ranks[k], tie(survivors[k]), k))[:max(limit, 0)])
    return [i for k, i in enumerate(survivors) if k in chosen]


@pytest.mark.parametrize("in_order", [True, False])
def test_select_rows_keeps_what_a_plain_sort_keeps(in_order, monkeypatch):
    import grpo.rejection.merge as merge

    monkeypatch.setattr(merge, "CHUNK", 7)  # prompts and repeated keys across the chunks' edges
    rng = np.random.default_rng(3)
    for trial in range(40):
        n = int(rng.integers(0, 120))
        ids = np.sort(rng.integers(0, max(n // 3, 1), n)) if in_order else rng.integers(0, 9, n)
        samples = np.zeros(n, np.int64)
        for p in np.unique(ids):  # distinct samples a prompt; shuffled prompts keep them unordered too
            at = np.flatnonzero(ids == p)
            samples[at] = np.arange(len(at)) if in_order else rng.permutation(len(at))
        pool = rng.integers(0, 2**64, max(n, 1), dtype=np.uint64)  # spread over the top bits the sorts split by
        keys = pool[rng.integers(0, len(pool), n)]  # about a third repeat an earlier one
        flags = rng.random(n) < 0.1 if trial % 2 else None
        dedupe, limit = bool(trial % 3), int(rng.integers(-1, n + 2))
        sel = select_rows(ids, samples, keys, flags, dedupe, limit, seed=trial)
        expected = reference_select(ids, samples, keys, flags, dedupe, limit, trial)
        kept = np.flatnonzero(sel.keep)
        assert (kept if sel.order is None else kept[sel.order]).tolist() == expected
        assert sel.kept == len(expected) and sel.in_order == (sel.order is None)
        if in_order and n:
            assert sel.in_order
        survivors = len(expected) + sel.over_target
        assert sel.duplicates + sel.contaminated + survivors == n


def test_a_bad_shard_file_fails_naming_it(tmp_path):
    tiny_shards(tmp_path)
    (tmp_path / "shard-00002.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"shard-00002\.parquet: not a readable shard"):
        merge_shards(tmp_path, CFG, num_shards=5)
    # a row without its sample index, in a shard written by hand: the file, row and column named
    table = pq.read_table(tmp_path / "shard-00001.parquet")
    column = table.column("sample_index").to_pylist()
    column[7] = None
    table = table.set_column(table.schema.get_field_index("sample_index"), "sample_index", pa.array(column))
    pq.write_table(table, tmp_path / "shard-00002.parquet")
    with pytest.raises(DataError, match=r"shard-00002\.parquet: row 7, column 'sample_index': empty"):
        write_merged(tmp_path, CFG, tmp_path / "out", num_shards=5)
    column[7] = -3  # a number no shard task writes
    table = table.set_column(table.schema.get_field_index("sample_index"), "sample_index", pa.array(column))
    pq.write_table(table, tmp_path / "shard-00002.parquet")
    with pytest.raises(DataError, match=r"shard-00002\.parquet: row 7, column 'sample_index': -3 is not a sample"):
        write_merged(tmp_path, CFG, tmp_path / "out", num_shards=5)
