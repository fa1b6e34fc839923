"""Sharded, resumable rejection sampling: plan shards, sample and curate each, write it as one Parquet file, merge.

A shard samples under a seed of its own, and its file is written atomically; a shard whose file exists is not
sampled again, so a crashed or cancelled run resumes without losing or duplicating rows. Must not depend on
Prefect or MLflow: the stage's Prefect tasks (tasks/rejection.py) map shards over a task runner.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from fsspec.implementations.local import LocalFileSystem
from tqdm.auto import tqdm

from grpo.configs.core import RejectionConfig
from grpo.data.tables import DataError, validate_rows
from grpo.rejection.curate import (
    KEPT_COLUMNS,
    ShardResult,
    curate,
    decontaminate,
    dedupe,
    prompt_text,
    reference_answer,
)
from grpo.rejection.filters import CONTAMINATED, DUPLICATE_ACROSS_SHARDS, OVER_TARGET, Counts
from grpo.rewards.correct import has_tests
from grpo.sampling.engines import Engine
from grpo.sampling.judge import Judge

# ----------------------------------------------------------------------------------------------------------------
# Sampling one shard

# Fields that only `merge_shards` reads: changing them between runs keeps the shards already written.
MERGE_ONLY_FIELDS = ("target_samples", "non_reasoning_rows", "decontamination_ngram", "decontamination_threshold")
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
                  judge: Judge | None, shard_index: int) -> ShardResult:
    """Sample `samples_per_prompt` completions for each prompt of the shard and curate them.

    Deterministic given (cfg, shard_rows, shard_index): an engine that samples with torch's RNG (the local
    engine) runs under the shard's seed; one that sends requests to servers (`takes_seed`, the HTTP engine)
    is handed the seed and derives each request's from it. `source_prompt_id` comes from that column (see
    `rows_of_shard`), else from the rows' index.
    """
    rows = validate_prompts(shard_rows, cfg, judge, source=f"shard {shard_index}")
    prompt_ids = rows["source_prompt_id"].tolist() if "source_prompt_id" in rows.columns else rows.index.tolist()
    seed = shard_seed(cfg.seed, shard_index)
    if getattr(engine, "takes_seed", False):
        # no process-wide RNG to guard: shards sampled by servers run side by side
        rollout = engine.generate(rows["prompt"].tolist(), cfg.samples_per_prompt, cfg.sampling, seed=seed)
    else:
        with seeded_torch(seed):
            rollout = engine.generate(rows["prompt"].tolist(), cfg.samples_per_prompt, cfg.sampling)
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
    return curate(samples, cfg, judge)


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
# Shard files: shard-00003.parquet (kept rows, counts in its metadata) and shard-00003.json (the counts)

COUNTS_KEY = b"r1.rejection.counts"

# A shard folder is a local path or any fsspec URI (file:///shared/mount/..., s3://bucket/...): with a task runner
# on a cluster, every node writes its shards to one store that the driver then merges from.


def _store(out_dir: str | Path) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem holding `out_dir` and the folder's path in it."""
    return fsspec.core.url_to_fs(str(out_dir))


def _join(out_dir: str | Path, name: str) -> str | Path:
    return f"{str(out_dir).rstrip('/')}/{name}" if "://" in str(out_dir) else Path(out_dir) / name


def shard_path(out_dir: str | Path, index: int) -> str | Path:
    """The shard's Parquet file: a Path for a local folder, a URI for a store."""
    return _join(out_dir, f"shard-{index:05d}.parquet")


def shard_done(out_dir: str | Path, index: int) -> bool:
    """True when the shard's Parquet file exists; it is only ever moved into place whole."""
    fs, root = _store(out_dir)
    return fs.isfile(f"{root}/shard-{index:05d}.parquet")


def _write_atomically(fs: fsspec.AbstractFileSystem, path: str, write: Callable[[Any], None]) -> None:
    """Write a temporary file beside `path`, then move it over `path`: readers see all or nothing.

    Locally (a shared mount included) the temporary file is fsynced and renamed; on an object store the final
    move is a copy that appears whole (a put is atomic there).
    """
    folder, name = path.rsplit("/", 1)
    if isinstance(fs, LocalFileSystem):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
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
        return
    tmp = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        with fs.open(tmp, "wb") as f:
            write(f)
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            fs.rm(tmp)
        raise


def check_writable(out_dir: str | Path) -> None:
    """Write and delete a probe file in `out_dir`, so an unwritable store fails before any shard is sampled."""
    fs, root = _store(out_dir)
    probe = f"{root}/.write-probe-{uuid.uuid4().hex}"
    try:
        fs.makedirs(root, exist_ok=True)
        _write_atomically(fs, probe, lambda f: f.write(b"probe"))
        fs.rm(probe)
    except Exception as e:
        raise PermissionError(f"shard store {str(out_dir)!r} is not writable ({type(e).__name__}: {e}); every "
                              f"shard is written there: give a folder or bucket the driver and every node can "
                              f"write") from None


def write_shard(result: ShardResult, out_dir: str | Path, index: int) -> str | Path:
    """Write the shard's kept rows and counts; the Parquet move comes last, so a present shard is a whole one."""
    fs, root = _store(out_dir)
    fs.makedirs(root, exist_ok=True)
    path = f"{root}/shard-{index:05d}.parquet"
    counts = json.dumps(result.counts.to_dict())
    _write_atomically(fs, path.removesuffix(".parquet") + ".json", lambda f: f.write(counts.encode()))
    table = pa.Table.from_pandas(result.kept, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), COUNTS_KEY: counts.encode()})
    _write_atomically(fs, path, lambda f: pq.write_table(table, f))
    return shard_path(out_dir, index)


def read_shard(out_dir: str | Path, index: int) -> ShardResult:
    """A written shard's kept rows and counts (the counts from the Parquet metadata, which always has them)."""
    fs, root = _store(out_dir)
    with fs.open(f"{root}/shard-{index:05d}.parquet", "rb") as f:
        table = pq.read_table(f)
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
    if num_shards is None:
        fs, root = _store(out_dir)
        indices = sorted(int(p.rsplit("/", 1)[1][len("shard-"):-len(".parquet")])
                         for p in fs.glob(f"{root}/shard-*.parquet"))
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
    fs, root = _store(out_dir)
    path = f"{root}/{MANIFEST}"
    if not fs.isfile(path):
        fs.makedirs(root, exist_ok=True)
        _write_atomically(fs, path, lambda f: f.write(json.dumps(want, indent=1).encode()))
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
    shards = plan_shards(prompts, cfg)
    todo = [s for s in shards if not shard_done(out_dir, s.index)]
    bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc="rejection sampling", disable=not progress)
    kept = 0
    for shard in todo:
        result = process_shard(engine, rows_of_shard(prompts, shard), cfg, judge, shard.index)
        write_shard(result, out_dir, shard.index)
        kept += result.counts.kept
        bar.update(1)
        bar.set_postfix(kept_this_run=kept)
        if on_shard:
            on_shard(shard.index, result.counts)
    bar.close()
    return merge_shards(out_dir, cfg, heldout, non_reasoning, num_shards=len(shards))
