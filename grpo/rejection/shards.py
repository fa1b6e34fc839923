"""Sharded, resumable rejection sampling: plan shards, sample and curate each, write it as one Parquet file, merge.

A shard samples under a seed of its own, and its file is written atomically; a shard whose file exists is not
sampled again, so a crashed or cancelled run resumes without losing or duplicating rows. Must not depend on
Prefect or MLflow: the stage's Prefect tasks (tasks/rejection.py) map shards over a task runner.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from grpo.configs.rejection import RejectionConfig
from grpo.data.tables import DataError, validate_rows
from grpo.rejection.budget import ShardTiming
from grpo.rejection.curate import (
    HeldoutIndex,
    ShardResult,
    build_heldout_index,
    curate,
    mark_rows,
    prompt_text,
    reference_answer,
)
from grpo.rejection.filters import Counts

# the shard files and the merge live in their own modules; the stage's callers find them here too
from grpo.rejection.merge import MergedDataset, RejectionResult, merge_shards, write_merged  # noqa: F401
from grpo.rejection.store import (  # noqa: F401
    check_writable,
    read_shard,
    read_timing,
    shard_done,
    shard_path,
    store_of,
    write_atomically,
    write_shard,
)
from grpo.rewards.correct import has_tests
from grpo.sampling.engines import Engine
from grpo.sampling.judge import Judge

# ----------------------------------------------------------------------------------------------------------------
# Sampling one shard

# Fields that only `merge_shards` reads: changing them between runs keeps the shards already written.
MERGE_ONLY_FIELDS = ("target_samples", "non_reasoning_rows", "decontamination_ngram", "decontamination_threshold",
                     "merge_batch_rows")
CODE_COLUMNS = ("tests", "io_tests", "setup", "language")  # a code row's tests, which travel with its samples


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


def process_shard(engine: Engine, shard_rows: pd.DataFrame, cfg: RejectionConfig,
                  judge: Judge | None, shard_index: int, heldout: HeldoutIndex | None = None) -> ShardResult:
    """Sample `samples_per_prompt` completions for each prompt of the shard and curate them.

    Deterministic given (cfg, shard_rows, shard_index): an engine that samples with torch's RNG (the local
    engine) runs under the shard's seed; one that sends requests to servers (`takes_seed`, the HTTP engine)
    is handed the seed and derives each request's from it. `source_prompt_id` comes from that column (see
    `rows_of_shard`), else from the rows' index. The kept rows' dedupe keys and, given `heldout`, their
    contamination flags are worked out here, where the samples are, so the merge only reads them.
    """
    rows = validate_prompts(shard_rows, cfg, judge, source=f"shard {shard_index}")
    prompt_ids = rows["source_prompt_id"].tolist() if "source_prompt_id" in rows.columns else rows.index.tolist()
    seed = shard_seed(cfg.seed, shard_index)
    start = time.perf_counter()
    if getattr(engine, "takes_seed", False):
        # no process-wide RNG to guard: shards sampled by servers run side by side
        rollout = engine.generate(rows["prompt"].tolist(), cfg.samples_per_prompt, cfg.sampling, seed=seed)
    else:
        with seeded_torch(seed):
            rollout = engine.generate(rows["prompt"].tolist(), cfg.samples_per_prompt, cfg.sampling)
    sample_s = time.perf_counter() - start
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
        "completion_tokens": rollout.completion_tokens.tolist(),
    })
    for column in CODE_COLUMNS:  # a code row's tests go with its samples: curate checks them by running the tests
        if column in rows.columns:
            samples[column] = pd.Series(repeat(rows[column].tolist()), dtype=object)
    timed = TimedJudge(judge) if judge is not None else None
    start = time.perf_counter()
    result = curate(samples, cfg, timed)
    timing = ShardTiming(len(samples), int(rollout.completion_tokens.sum()), sample_s, time.perf_counter() - start,
                         timed.seconds if timed else 0.0, timed.calls if timed else 0)
    return result._replace(marks=mark_rows(result.kept, heldout), timing=timing)


class TimedJudge:
    """A judge that also measures how long its caller waited on it and how many calls it sent meanwhile (the
    judge's own `calls` where it counts them, retries included; else the items asked)."""

    def __init__(self, judge: Judge):
        self.judge_backend, self.seconds, self.calls = judge, 0.0, 0

    def judge(self, prompt: str, response: str, reference: str | None):
        return self.judge_many([(prompt, response, reference)])[0]

    def judge_many(self, items: list) -> list:
        before = getattr(self.judge_backend, "calls", None)
        start = time.perf_counter()
        try:
            return self.judge_backend.judge_many(items)
        finally:
            self.seconds += time.perf_counter() - start
            after = getattr(self.judge_backend, "calls", None)
            self.calls += len(items) if before is None or after is None else after - before


def validate_prompts(prompts_df: pd.DataFrame, cfg: RejectionConfig, judge: Judge | None,
                     source: str = "prompts") -> pd.DataFrame:
    """Check the prompt table before any sampling; return it with answers as text or None.

    A row without an `answer` or tests can only be checked by the judge: with no judge and judge_when != "never"
    that is an error here, not an hour of sampling thrown away later.
    """
    validate_rows(prompts_df, {"prompt": "text or chat messages"}, source)
    if cfg.judge_when == "always" and judge is None:
        raise ValueError("judge_when='always' asks the judge about every sample, but no judge was given")
    rows = prompts_df.copy()
    rows["prompt"] = [p.tolist() if hasattr(p, "tolist") else p for p in rows["prompt"]]
    answers = [reference_answer(a) for a in rows["answer"]] if "answer" in rows.columns else [None] * len(rows)
    if "answer" in rows.columns:
        rows["answer"] = pd.Series(answers, index=rows.index, dtype=object)  # None, not a string dtype's NaN
    tested = [has_tests(t, io) for t, io in zip(*(rows[c].tolist() if c in rows.columns else [None] * len(rows)
                                                   for c in ("tests", "io_tests")))]
    no_answer = [i for i, a in enumerate(answers) if a is None and not tested[i]]
    if no_answer and judge is None and cfg.judge_when != "never":
        where = "has no 'answer' column" if "answer" not in rows.columns else (
            f"row {no_answer[0]}, column 'answer': empty ({len(no_answer)} rows have no answer)")
        raise DataError(f"{source}: {where}; a row without a reference answer or tests needs a judge: pass "
                        f"judge=..., or set judge_when='never' to drop such rows")
    return rows


# ----------------------------------------------------------------------------------------------------------------
# The whole stage without Prefect

MANIFEST = "manifest.json"


def _manifest(prompts: pd.DataFrame, cfg: RejectionConfig) -> dict[str, Any]:
    """What the shards depend on: the prompt table and every config field but the merge-only ones."""
    table = json.dumps([[prompt_text(p), a] for p, a in zip(
        prompts["prompt"], prompts["answer"] if "answer" in prompts.columns else [None] * len(prompts))])
    tested = {"tests", "io_tests"} & set(prompts.columns)
    code = [c for c in CODE_COLUMNS if c in prompts.columns] if tested else []
    if code:  # tests and code settings only where rows have tests, so folders of math shards still resume
        table += json.dumps([[prompts[c].iloc[i] for c in code] for i in range(len(prompts))],
                            default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v))  # Parquet's arrays
    exclude = set(MERGE_ONLY_FIELDS) | (set() if code else {"code"})
    return {"prompts_sha256": hashlib.sha256(table.encode()).hexdigest(), "num_prompts": len(prompts),
            "config": cfg.model_dump(mode="json", exclude=exclude)}


def check_manifest(out_dir: str | Path, prompts: pd.DataFrame, cfg: RejectionConfig) -> None:
    """Record what the shards in `out_dir` are made from, or refuse to mix in shards made from something else."""
    want = _manifest(prompts, cfg)
    fs, root = store_of(out_dir)
    path = f"{root}/{MANIFEST}"
    if not fs.isfile(path):
        fs.makedirs(root, exist_ok=True)
        write_atomically(fs, path, lambda f: f.write(json.dumps(want, indent=1).encode()))
        return
    have = json.loads(fs.cat_file(path))
    if have != want:
        changed = [k for k in ("prompts_sha256", "num_prompts") if have.get(k) != want[k]]
        changed += [f"config.{k}" for k in want["config"] if have.get("config", {}).get(k) != want["config"][k]]
        raise ValueError(f"{out_dir} holds shards made from other inputs (changed: {', '.join(changed)}); "
                         f"use a new folder, or delete the old shards and {MANIFEST}")


def run_rejection_sampling(engine: Engine, prompts_df: pd.DataFrame, cfg: RejectionConfig,
                           out_dir: str | Path, judge: Judge | None = None,
                           heldout: pd.DataFrame | Sequence[Any] | None = None,
                           non_reasoning: pd.DataFrame | None = None, progress: bool = True,
                           on_shard: Callable[[int, Counts], None] | None = None) -> RejectionResult:
    """Sample every shard not yet written to `out_dir`, then merge all of them into the dataset.

    Everything is checked before sampling starts, the engine's servers too where it has any (`check_available`).
    `on_shard(index, counts)` is called after each shard written.
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
    check_servers = getattr(engine, "check_available", None)
    if check_servers is not None:
        check_servers(cfg.sampling)
    check_manifest(out_dir, prompts, cfg)
    index = None  # checked in each shard, where its samples are; the merge only reads the flags
    if heldout is not None and cfg.decontamination_ngram:
        index = build_heldout_index(heldout["prompt"].tolist() if isinstance(heldout, pd.DataFrame) else list(heldout),
                                    cfg.decontamination_ngram, cfg.decontamination_threshold)
    shards = plan_shards(prompts, cfg)
    todo = [s for s in shards if not shard_done(out_dir, s.index)]
    bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc="rejection sampling", disable=not progress)
    kept = 0
    for shard in todo:
        result = process_shard(engine, rows_of_shard(prompts, shard), cfg, judge, shard.index, index)
        write_shard(result, out_dir, shard.index)
        kept += result.counts.kept
        bar.update(1)
        bar.set_postfix(kept_this_run=kept)
        if on_shard:
            on_shard(shard.index, result.counts)
    bar.close()
    return merge_shards(out_dir, cfg, heldout, non_reasoning, num_shards=len(shards))
