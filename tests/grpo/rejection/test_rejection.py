"""Rejection sampling: readability filters on hand-made text, curation and its counts, dedupe and decontamination,
and shards that are deterministic, written atomically, and resumed after a crash to exactly the same dataset."""

from __future__ import annotations

import os
import re
import uuid
from typing import NamedTuple

import fsspec
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError

from grpo.configs.data import TaskConfig
from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.configs.rejection import RejectionConfig
from grpo.configs.sampling import SamplingConfig
from grpo.data.arithmetic import generate_problems, rl_rows
from grpo.data.tables import DataError
from grpo.models import load_model_and_tokenizer
from grpo.rejection.curate import KEPT_COLUMNS, contamination_mask, curate, decontaminate, dedupe
from grpo.rejection.filters import READABILITY_CHECKS, Counts, summary_line
from grpo.rejection.merge import write_merged
from grpo.rejection.shards import (
    check_writable,
    merge_shards,
    plan_shards,
    process_shard,
    read_shard,
    rows_of_shard,
    run_rejection_sampling,
    shard_done,
    shard_path,
    write_shard,
)
from grpo.rewards import extract_answer
from grpo.sampling.local.backend import Rollout, TransformersBackend

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)
CFG = RejectionConfig()
GOOD = "<think>Given 8, 5. 8 + 5 = 13.</think><answer>13</answer>"


def said(answer: str, reasoning: str = "Given 8, 5. 8 + 5 = 13.") -> str:
    return f"<think>{reasoning}</think><answer>{answer}</answer>"


def changed(cfg: RejectionConfig, **changes) -> RejectionConfig:
    """A validated copy (model_copy would skip the checks)."""
    return RejectionConfig.model_validate({**cfg.model_dump(), **changes})


def adds_up(counts: Counts) -> bool:
    return counts.generated == counts.kept + sum(counts.dropped.values()) + sum((counts.ungraded or {}).values())


# ----------------------------------------------------------------------------------------------------------------
# Judges for tests: deterministic classes with the shape of grpo.sampling.judge.Judge (the model judges live there)

class Verdict(NamedTuple):  # the shape of grpo.sampling.judge.Verdict
    accepted: bool | None
    rationale: str


class ExactMatchJudge:
    """Accepts when the extracted answer is the reference, character for character (so "12.0" is not "12").

    Without a reference it looks the prompt up in `key` (a judge that knows the answer); a prompt it does not know
    gets an unparseable verdict, as a model judge's unreadable output would.
    """

    def __init__(self, key: dict[str, str] | None = None):
        self.key, self.asked = key or {}, 0

    def judge(self, prompt: str, response: str, reference: str | None) -> Verdict:
        self.asked += 1
        reference = reference if reference is not None else self.key.get(prompt)
        if reference is None:
            return Verdict(None, "no verdict")
        got = extract_answer(response)
        return Verdict(got == reference, f"answer {got!r}, reference {reference!r}")

    def judge_many(self, items):
        return [self.judge(*item) for item in items]


class AcceptAllJudge:
    """Accepts everything: lets a random-weight model's samples through, so the shard machinery has rows to keep."""

    def judge(self, prompt, response, reference):
        return Verdict(True, "accepted")

    def judge_many(self, items):
        return [self.judge(*item) for item in items]


# ----------------------------------------------------------------------------------------------------------------
# Readability filters

@pytest.mark.parametrize("name, bad, why", [
    ("tags", "<think>8 + 5 = 13.</think>13", "</answer> x0"),
    ("tags", "<think>a</think><think>b</think><answer>13</answer>", "<think> x2"),
    ("tags", "<answer>13</answer><think>8 + 5 = 13.</think>", "out of order"),
    ("tags", "Sure! " + GOOD, "before <think>"),
    ("tags", "<think>8 + 5 = 13.</think> so <answer>13</answer>", "between </think> and <answer>"),
    ("tags", GOOD + " Hope that helps!", "after </answer>"),
    ("language", said("13", "我们先把八和五相加 then we get 13"), "of the reasoning's words are en"),
    ("paragraph_length", said("13", "Add them.\n\n" + "word " * 500), "a paragraph of"),
    ("reasoning_length", said("13", "Add them. " * 1000), "reasoning of"),
    ("code_in_reasoning", said("13", "```python\nprint(8 + 5)\n```"), "code block"),
    ("empty_answer", said("  "), "empty"),
    ("repetition", said("13", "Wait, let me check that again.\n" * 5), "repeated 5 times"),
    ("repetition", said("13", "1" * 600), "compresses"),
])
def test_each_filter_drops_its_defect_and_passes_a_clean_response(name, bad, why):
    check = READABILITY_CHECKS[name]
    assert check(GOOD, CFG) == (True, "")
    ok, reason = check(bad, CFG)
    assert not ok and why in reason


def test_filters_leave_alone_what_is_not_a_defect():
    # no words at all (pure arithmetic) is not mixed language; code in the answer is fine; short paragraphs are fine
    assert READABILITY_CHECKS["language"](said("13", "8 + 5 = 13"), CFG).ok
    assert READABILITY_CHECKS["code_in_reasoning"](said("```print(13)```"), CFG).ok
    assert READABILITY_CHECKS["paragraph_length"](said("13", "Add them.\n\n" * 300), CFG).ok
    assert READABILITY_CHECKS["repetition"](said("13", "Add them.\n" * 3), CFG).ok  # 3 is the limit
    # thresholds come from the config
    assert not READABILITY_CHECKS["reasoning_length"](GOOD, changed(CFG, max_reasoning_chars=10)).ok


def test_the_config_names_its_filters_from_the_registry():
    with pytest.raises(ValidationError, match="unknown readability filter.*'tags'"):
        RejectionConfig(filters=("tags", "no_such_filter"))
    with pytest.raises(ValidationError, match="non_reasoning_rows"):
        RejectionConfig(target_samples=10, non_reasoning_rows=10)


# ----------------------------------------------------------------------------------------------------------------
# Curation: filters, duplicates, verdicts, per-prompt cap, and counts that add up

def samples(rows: list[tuple]) -> pd.DataFrame:
    """(prompt, answer, response) triples; sample_index counts up within each prompt."""
    df = pd.DataFrame(rows, columns=["prompt", "answer", "response"])
    df["source_prompt_id"] = pd.factorize(df["prompt"])[0]
    df["sample_index"] = df.groupby("source_prompt_id").cumcount()
    return df


def test_curate_keeps_correct_readable_samples_and_counts_each_drop_once():
    q, r = "Ava has 8 apples and buys 5. How many?", "Ben has 9 pens and loses 2. How many?"
    result = curate(samples([
        (q, "13", said("13")),  # kept
        (q, "13", said("13").upper().replace("<THINK>", "<think>").replace("</THINK>", "</think>")
         .replace("<ANSWER>", "<answer>").replace("</ANSWER>", "</answer>")),  # the first, case aside: duplicate
        (q, "13", said("12")),  # incorrect
        (q, "13", "<think>8 + 5 = 13."),  # tags (truncated)
        (q, "13", said("13", "Add 8 and 5 to get 13.")),  # kept: the prompt's second correct sample
        (q, "13", said("13", "Eight plus five is 13.")),  # correct, but over max_kept_per_prompt=2
        (r, "7", said("7", "Given 9, 2. 9 - 2 = 7.")),  # kept
        (r, "7", said("7", "```\n9 - 2\n```")),  # code_in_reasoning
    ]), CFG)
    assert result.kept["response"].tolist() == [said("13"), said("13", "Add 8 and 5 to get 13."),
                                                said("7", "Given 9, 2. 9 - 2 = 7.")]
    assert set(result.kept["verdict_source"]) == {"rule"}
    dropped = {k: v for k, v in result.counts.dropped.items() if v}
    assert dropped == {"tags": 1, "code_in_reasoning": 1, "duplicate": 1, "incorrect": 1, "per_prompt_cap": 1}
    assert result.counts.generated == 8 and result.counts.kept == 3 and adds_up(result.counts)
    assert result.counts.rule_checked == 5 and result.counts.judge_asked == 0
    assert result.samples["drop_reason"].tolist()[:4] == ["", "duplicate", "incorrect", "tags"]


def test_rows_without_an_answer_go_to_the_judge():
    known, wrong, unknown = "What is 2 + 2?", "What is 3 + 3?", "Write a haiku."
    rows = samples([(known, None, said("4")), (wrong, None, said("5")), (unknown, None, said("a poem"))])
    judge = ExactMatchJudge(key={known: "4", wrong: "6"})
    result = curate(rows, CFG, judge)
    assert result.kept["prompt"].tolist() == [known]
    assert result.kept["verdict_source"].tolist() == ["judge"]
    assert result.kept["judge_rationale"].tolist() == ["answer '4', reference '4'"]
    c = result.counts
    assert (c.judge_asked, c.judge_accepted, c.judge_unparseable) == (3, 1, 1)
    # no verdict is no grade: neither kept nor rejected, counted apart by why
    assert c.dropped["judge_rejected"] == 1 and c.ungraded == {"judge_no_verdict": 1} and adds_up(c)
    assert "judge_unparseable" not in c.dropped
    assert result.samples["ungraded"].tolist() == ["", "", "judge_no_verdict"]

    never = curate(rows, changed(CFG, judge_when="never"), judge := ExactMatchJudge())
    assert judge.asked == 0 and never.counts.dropped["unverifiable"] == 3 and never.counts.kept == 0


def test_judge_when_always_lets_the_rule_decide_and_measures_agreement():
    q = "Ava has 8 apples and buys 4. How many?"
    rows = samples([(q, "12", said("12", "a")), (q, "12", said("12.0", "b")), (q, "12", said("7", "c"))])
    result = curate(rows, changed(CFG, judge_when="always", max_kept_per_prompt=0),
                    ExactMatchJudge())
    # the rule accepts 12 and 12.0 (the same number) and rejects 7; the exact-match judge accepts only "12"
    assert result.kept["response"].tolist() == [said("12", "a"), said("12.0", "b")]
    assert result.kept["judge_accepted"].tolist() == [True, False]
    c = result.counts
    assert (c.rule_checked, c.judge_asked, c.both_checked, c.agreed) == (3, 3, 3, 2)
    assert c.metrics()["rejection/judge_rule_agreement"] == pytest.approx(2 / 3)


def test_judge_when_appeal_keeps_what_the_judge_accepts_of_the_rules_negatives_and_never_drops_a_positive():
    """The rule misses "XII" (and rightly rejects 7); the judge, asked only about those two with the reference,
    accepts the first: kept as an appeal. The rule's 12 stands without asking."""
    q = "Ava has 8 apples and buys 4. How many?"
    rows = samples([(q, "12", said("12", "a")), (q, "12", said("XII", "b")), (q, "12", said("7", "c"))])

    class Lenient(ExactMatchJudge):
        def judge(self, prompt, response, reference):
            self.asked += 1
            return Verdict(extract_answer(response) in ("XII", reference), "reads words too")

    result = curate(rows, changed(CFG, judge_when="appeal", max_kept_per_prompt=0), judge := Lenient())
    assert judge.asked == 2  # the two negatives; never the rule's positive
    assert result.kept["response"].tolist() == [said("12", "a"), said("XII", "b")]
    assert result.kept["verdict_source"].tolist() == ["rule", "appeal"]
    assert result.counts.appeal_upheld == 1 and result.counts.dropped["incorrect"] == 1 and adds_up(result.counts)


# ----------------------------------------------------------------------------------------------------------------
# Dedupe and decontamination

def test_dedupe_ignores_case_and_whitespace_but_not_the_prompt():
    rows = pd.DataFrame({"prompt": ["Q1", "q1 ", "Q1", "Q2"],
                         "response": ["<think>A  b</think>", "<think>a b</think>", "<think>a c</think>",
                                      "<think>a b</think>"]})
    assert dedupe(rows).index.tolist() == [0, 2, 3]


def test_decontamination_catches_copied_heldout_problems_and_keeps_unrelated_rows():
    task = TaskConfig()
    heldout = [p.question for p in generate_problems(task, 50, "heldout")]
    train = [p.question for p in generate_problems(task, 200, "train")]
    renamed = re.sub(r"^\w+", "Zed", heldout[0])  # the same problem about someone else
    rows = pd.DataFrame({
        "prompt": [*train, renamed, train[0], "Say hi."],
        "response": [GOOD] * len(train) + [GOOD, said("5", f"The problem: {heldout[1]} So 5."), GOOD],
    })
    kept = decontaminate(rows, heldout + ["say hi"], n=8, threshold=0.8)
    # the training problems share template wording with held-out ones but are different problems: all kept;
    # the renamed copy, the response quoting a held-out problem, and a whole short held-out prompt are caught
    assert kept.index.tolist() == list(range(len(train)))
    assert contamination_mask(["Nothing like it."], heldout) == [False]


# ----------------------------------------------------------------------------------------------------------------
# Shards

class CannedBackend:
    """Draws each completion from a fixed list per prompt with torch's global RNG, as sampling does.

    The random-weight model's samples are never correct; these are, some of the time, so the kept set is rich.
    """

    def __init__(self, answers: dict[str, str]):
        self.answers, self.calls = answers, 0

    def generate(self, prompts: list, n: int, sampling: SamplingConfig) -> Rollout:
        self.calls += 1
        texts = []
        for p in prompts:
            a = self.answers[p]
            options = [said(a, "First try."), said(a, "Second try."), said(a, "Third try."), said(a + "1"),
                       "<think>no answer"]
            texts += [options[i] for i in torch.randint(len(options), (n,)).tolist()]
        ones = torch.ones(len(texts), 1, dtype=torch.long)
        return Rollout(texts, torch.zeros(len(texts), dtype=torch.bool), ones, ones, ones, ones, ones.float())


class CrashingBackend:
    """Passes calls through to `inner` and raises on call number `crash_on` (a worker killed mid-shard)."""

    def __init__(self, inner, crash_on: int | None = None):
        self.inner, self.crash_on, self.calls = inner, crash_on, 0

    def generate(self, prompts, n, sampling):
        self.calls += 1
        if self.calls == self.crash_on:
            raise RuntimeError("worker killed")
        return self.inner.generate(prompts, n, sampling)


@pytest.fixture(scope="module")
def tiny_backend():
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    return TransformersBackend(model, tok)


PROBLEMS = rl_rows(generate_problems(TaskConfig(), 10, "train"))
TINY_CFG = RejectionConfig(samples_per_prompt=2, shard_size=4, sampling=SamplingConfig(max_new_tokens=12),
                           max_kept_per_prompt=0, filters=())


def test_plan_shards_covers_every_prompt_once():
    plan = plan_shards(PROBLEMS, TINY_CFG)
    assert [(s.start, s.stop) for s in plan] == [(0, 4), (4, 8), (8, 10)]
    assert rows_of_shard(PROBLEMS, plan[2])["source_prompt_id"].tolist() == [8, 9]


def test_a_shard_sampled_twice_gives_the_same_samples(tiny_backend):
    rows = rows_of_shard(PROBLEMS, plan_shards(PROBLEMS, TINY_CFG)[0])
    a = process_shard(tiny_backend, rows, TINY_CFG, None, shard_index=0)
    torch.rand(5)  # whatever the caller's RNG did in between
    b = process_shard(tiny_backend, rows, TINY_CFG, None, shard_index=0)
    other = process_shard(tiny_backend, rows, TINY_CFG, None, shard_index=1)
    cols = ["source_prompt_id", "sample_index", "response", "completion_tokens", "drop_reason"]
    pd.testing.assert_frame_equal(a.samples[cols], b.samples[cols])
    assert a.samples["response"].tolist() != other.samples["response"].tolist()  # each shard has its own seed
    assert len(a.samples) == 8 and adds_up(a.counts)
    state = torch.get_rng_state()
    process_shard(tiny_backend, rows, TINY_CFG, None, shard_index=0)
    assert torch.equal(state, torch.get_rng_state())  # sampling a shard leaves the caller's RNG where it was


def _tiny_model_case(tiny_backend):
    """The real tiny model; prompts without answers and a judge that accepts all, so every sample is kept."""
    return tiny_backend, PROBLEMS.drop(columns="answer"), TINY_CFG, AcceptAllJudge()


def _canned_case(_):
    """Canned completions checked by the rule: some correct, some wrong, some broken."""
    backend = CannedBackend(dict(zip(PROBLEMS["prompt"], PROBLEMS["answer"])))
    cfg = changed(TINY_CFG, samples_per_prompt=4, filters=CFG.filters, max_kept_per_prompt=2, target_samples=12)
    return backend, PROBLEMS, cfg, None


@pytest.mark.parametrize("case", [_tiny_model_case, _canned_case])
def test_resuming_after_a_crash_gives_exactly_the_same_dataset(case, tiny_backend, tmp_path):
    backend, prompts, cfg, judge = case(tiny_backend)
    full = run_rejection_sampling(backend, prompts, cfg, tmp_path / "full", judge, progress=False)
    assert len(full.dataset) > 0 and adds_up(full.counts) and full.counts.generated == 10 * cfg.samples_per_prompt

    # a run killed while sampling its second shard, which also left a half-written temporary file behind
    crashed = CrashingBackend(backend, crash_on=2)
    with pytest.raises(RuntimeError, match="worker killed"):
        run_rejection_sampling(crashed, prompts, cfg, tmp_path / "resumed", judge, progress=False)
    assert shard_done(tmp_path / "resumed", 0) and not shard_done(tmp_path / "resumed", 1)
    (tmp_path / "resumed" / ".shard-00001.parquet.x1y2.tmp").write_bytes(b"PAR1 half a file")
    again = CrashingBackend(backend)
    resumed = run_rejection_sampling(again, prompts, cfg, tmp_path / "resumed", judge, progress=False)
    assert again.calls == 2  # shards 1 and 2 only: shard 0 was not sampled again
    pd.testing.assert_frame_equal(resumed.dataset, full.dataset)
    assert resumed.counts == full.counts

    # losing a finished shard (deleted, or a disk that never got it) costs that shard alone
    shard_path(tmp_path / "full", 2).unlink()
    once = CrashingBackend(backend)
    rerun = run_rejection_sampling(once, prompts, cfg, tmp_path / "full", judge, progress=False)
    assert once.calls == 1
    pd.testing.assert_frame_equal(rerun.dataset, full.dataset)


def test_a_failed_write_leaves_no_shard_file(tmp_path, monkeypatch):
    result = curate(samples([("Q", "13", GOOD)]), CFG)

    def write_half_then_fail(table, where, **kwargs):
        where.write(b"PAR1 half a file")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        write_shard(result, tmp_path, 3)
    assert not shard_done(tmp_path, 3)
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob("*.tmp"))
    monkeypatch.undo()

    write_shard(result, tmp_path, 3)
    back = read_shard(tmp_path, 3)
    assert back.counts == result.counts and back.kept["response"].tolist() == [GOOD]
    assert sorted(os.listdir(tmp_path)) == ["shard-00003.json", "shard-00003.parquet"]


def test_merge_dedupes_across_shards_caps_covering_prompts_first_and_adds_non_reasoning_rows(tmp_path):
    cfg = changed(CFG, target_samples=5, non_reasoning_rows=2)
    first = samples([("Q0", "1", said("1", "a")), ("Q0", "1", said("1", "b")),
                     ("Q1", "2", said("2", "a")), ("Q1", "2", said("2", "b"))])
    second = samples([("Q2", "3", said("3", "a")), ("Q2", "3", said("3", "b")), ("Q0", "1", said("1", "a"))])
    second["source_prompt_id"] = [2, 2, 3]  # Q0 asked again under another id: its sample repeats shard 0's
    write_shard(curate(first, cfg), tmp_path, 0)
    write_shard(curate(second, cfg), tmp_path, 1)
    chat = pd.DataFrame({"prompt": ["Write a haiku.", "Say hi.", "Unused."], "response": ["...", "Hi!", "-"]})
    result = merge_shards(tmp_path, cfg, heldout=["Q9"], non_reasoning=chat, num_shards=2)

    reasoning = result.dataset[result.dataset["kind"] == "reasoning"]
    assert reasoning["source_prompt_id"].tolist() == [0, 1, 2]  # one row per prompt before any prompt's second
    assert result.dataset[result.dataset["kind"] == "non_reasoning"]["prompt"].tolist() == ["Write a haiku.",
                                                                                           "Say hi."]
    c = result.counts
    assert c.generated == 7 and c.kept == 3 and result.non_reasoning == 2 and adds_up(c)
    assert c.dropped["duplicate_across_shards"] == 1 and c.dropped["over_target"] == 3
    with pytest.raises(FileNotFoundError, match=r"shard\(s\) \[2\]"):
        merge_shards(tmp_path, cfg, num_shards=3)


def test_bad_inputs_fail_before_any_sampling(tmp_path):
    never_called = CrashingBackend(None, crash_on=1)
    no_answers = PROBLEMS.drop(columns="answer")
    with pytest.raises(DataError, match="no 'answer' column.*needs a judge"):
        run_rejection_sampling(never_called, no_answers, TINY_CFG, tmp_path, progress=False)
    blank = PROBLEMS.assign(answer=["7"] * 9 + [""])
    with pytest.raises(DataError, match="row 9, column 'answer'"):
        run_rejection_sampling(never_called, blank, TINY_CFG, tmp_path, progress=False)
    with pytest.raises(DataError, match="missing column.*'prompt'"):
        run_rejection_sampling(never_called, PROBLEMS.rename(columns={"prompt": "question"}), TINY_CFG, tmp_path,
                               progress=False)
    with pytest.raises(ValueError, match="judge_when='always'"):
        run_rejection_sampling(never_called, PROBLEMS, changed(TINY_CFG, judge_when="always"),
                               tmp_path, progress=False)
    with pytest.raises(ValueError, match="no non-reasoning rows"):
        run_rejection_sampling(never_called, PROBLEMS, changed(TINY_CFG, non_reasoning_rows=5),
                               tmp_path, progress=False)
    assert never_called.calls == 0


def test_a_folder_keeps_shards_from_one_set_of_inputs(tmp_path):
    backend = CannedBackend(dict(zip(PROBLEMS["prompt"], PROBLEMS["answer"])))
    run_rejection_sampling(backend, PROBLEMS, TINY_CFG, tmp_path, progress=False)
    with pytest.raises(ValueError, match="config.samples_per_prompt"):
        run_rejection_sampling(backend, PROBLEMS, changed(TINY_CFG, samples_per_prompt=3), tmp_path,
                               progress=False)
    with pytest.raises(ValueError, match="prompts_sha256"):
        run_rejection_sampling(backend, PROBLEMS.iloc[::-1], TINY_CFG, tmp_path, progress=False)
    calls = backend.calls
    smaller = run_rejection_sampling(backend, PROBLEMS, changed(TINY_CFG, target_samples=3),
                                     tmp_path, progress=False)  # a merge-only change: the shards are reused
    assert backend.calls == calls and len(smaller.dataset) == 3


def test_merge_with_nothing_kept_keeps_the_columns(tmp_path):
    """A model that gets nothing right still yields a dataset with the kept rows' columns: sampled, curated, merged
    in memory and written as files, the non-reasoning rows then its only rows."""
    wrong = CannedBackend({p: "not the answer" for p in PROBLEMS["prompt"]})
    cfg = changed(TINY_CFG, target_samples=6, non_reasoning_rows=2)
    chat = pd.DataFrame({"prompt": ["Write a haiku.", "Say hi."], "response": ["...", "Hi!"]})
    result = run_rejection_sampling(wrong, PROBLEMS, cfg, tmp_path / "shards", non_reasoning=chat, progress=False)
    assert result.counts.generated == 2 * len(PROBLEMS) and result.counts.kept == 0
    right = CannedBackend(dict(zip(PROBLEMS["prompt"], PROBLEMS["answer"])))
    some = run_rejection_sampling(right, PROBLEMS, cfg, tmp_path / "some", non_reasoning=chat, progress=False)
    assert some.counts.kept > 0 and list(result.dataset.columns) == list(some.dataset.columns)
    assert result.dataset["kind"].tolist() == ["non_reasoning"] * 2
    written = write_merged(tmp_path / "shards", cfg, tmp_path / "curated", non_reasoning=chat)
    table = pq.read_table(written.files)
    assert table.column_names == list(some.dataset.columns) and written.rows == 2 and written.counts.kept == 0
    empty = pd.DataFrame(columns=KEPT_COLUMNS)  # the in-memory helpers too
    assert list(dedupe(empty).columns) == KEPT_COLUMNS
    assert list(decontaminate(empty, ["a b c d e f g h i j"], 8, 0.8).columns) == KEPT_COLUMNS


def test_shards_in_an_fsspec_store_resume_and_merge_like_a_local_folder(tiny_backend, tmp_path):
    """A store URI (here fsspec's in-memory filesystem, standing for an object store) holds shards, the manifest
    and resumes exactly like a local folder: the non-local branch writes a temporary object and moves it."""
    backend, prompts, cfg, judge = _canned_case(tiny_backend)
    local = run_rejection_sampling(backend, prompts, cfg, tmp_path / "local", judge, progress=False)
    store = f"memory://r1-test-{uuid.uuid4().hex}/shards"
    crashed = CrashingBackend(backend, crash_on=2)
    with pytest.raises(RuntimeError, match="worker killed"):
        run_rejection_sampling(crashed, prompts, cfg, store, judge, progress=False)
    assert shard_done(store, 0) and not shard_done(store, 1)
    again = CrashingBackend(backend)
    resumed = run_rejection_sampling(again, prompts, cfg, store, judge, progress=False)
    assert again.calls == 2
    pd.testing.assert_frame_equal(resumed.dataset, local.dataset)
    fs, root = fsspec.core.url_to_fs(store)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False)) == [
        "manifest.json", *[f"shard-0000{i}.{ext}" for i in range(3) for ext in ("json", "parquet")]]
    pd.testing.assert_frame_equal(merge_shards(store, cfg).dataset, local.dataset)  # every shard file, by glob


def test_an_unwritable_store_is_refused_before_sampling(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(PermissionError, match="shard store 'file://.*a-file/shards' is not writable"):
        check_writable(f"file://{tmp_path}/a-file/shards")
    check_writable(f"file://{tmp_path}/fine")
    assert os.listdir(tmp_path / "fine") == []  # the probe is gone


def test_the_summary_line_shows_what_was_kept_and_only_the_filters_that_dropped_something():
    counts = Counts.zero(RejectionConfig())._replace(generated=20, kept=5, truncated=2, judge_asked=4,
                                                     judge_accepted=3)
    counts.dropped.update({"incorrect": 9, "repetition": 2, "per_prompt_cap": 4})
    metrics = {**counts.metrics(), "rejection/rows": 7.0, "rejection/non_reasoning_rows": 2.0}
    line = summary_line(metrics)
    assert line == ("kept 5 of 20 samples (keep rate 0.250), 7 rows with 2 non-reasoning; "
                    "dropped: incorrect 9, per_prompt_cap 4, repetition 2; judge accepted 3 of 4; 2 truncated")
    assert "tags" not in line and "=0" not in line  # the filters that dropped nothing are left out


def test_the_cli_prints_the_rejection_summary_line():
    from flows.cli.summary import table
    from runtime.stage import StageResult

    counts = Counts.zero(RejectionConfig())._replace(generated=8, kept=2)
    counts.dropped["incorrect"] = 6
    out = table({"rejection_sampling": StageResult(stage="rejection_sampling", run_id="r", uris={},
                                                   metrics=counts.metrics())}, "r")
    assert "kept 2 of 8 samples (keep rate 0.250); dropped: incorrect 6" in out and "dropped/tags" not in out
