"""Tasks: rejection sampling in shards (one Prefect task per shard, one Parquet file each), then the merge."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
from prefect import task
from prefect.logging import get_run_logger

from grpo.config import SELF_JUDGE, ModelConfig, RejectionSamplingConfig
from grpo.data.tables import read_table, validate_rows
from grpo.models import load_model_and_tokenizer
from grpo.rejection import shards
from grpo.rejection.filters import summary_line
from grpo.sampling.backend import TransformersBackend
from grpo.sampling.judge import HTTPJudge, build_judge
from tasks import tracking
from tasks.data import read_frame
from tasks.stage import resolve_model, work_dir



class RejectionPlan(NamedTuple):
    out_dir: str  # shard files live here, keyed by everything that decides their content
    shards: list[int]  # every shard index of the plan (written ones are skipped by the shard task)
    prompts_uri: str  # the validated prompt table
    model_dir: str  # local copy of the checkpoint
    non_reasoning_uri: str | None  # the non-reasoning rows to append, if the config asks for any


@task(name="plan_rejection_sampling")
def plan_rejection_sampling(run_id: str, checkpoint_uri: str, cfg: RejectionSamplingConfig,
                            prompts_uri: str) -> RejectionPlan:
    """Check everything that can be checked before sampling (prompts, judge endpoint, non-reasoning rows)."""
    rs = cfg.rejection
    judge_cfg = cfg.judge
    if judge_cfg is not None and judge_cfg.backend == "http" and rs.judge_when != "never":
        HTTPJudge(judge_cfg).check_available()  # a down endpoint fails the stage now, before any shard is sampled
    # only whether there will be a judge matters here; the shard tasks build it
    will_judge = judge_cfg if judge_cfg is not None and rs.judge_when != "never" else None
    prompts = shards.validate_prompts(read_frame(prompts_uri).reset_index(drop=True), rs, will_judge,
                                         source=prompts_uri)
    non_reasoning_uri = None
    if rs.non_reasoning_rows:
        rows = non_reasoning_rows(cfg.non_reasoning_source, rs.non_reasoning_rows, rs.seed)
        non_reasoning_uri = tracking.log_frame(run_id, rows, "dataset/non_reasoning")
    model_cfg = resolve_model(cfg.model, checkpoint_uri)
    shard_keys = rs.model_dump(mode="json", exclude=set(shards.MERGE_ONLY_FIELDS))
    out = work_dir("rejection_sampling", checkpoint_uri, cfg.model, judge_cfg, shard_keys, cfg.data)
    shards.check_manifest(out, prompts, rs)  # refuses to mix shards made from other prompts or settings
    indices = [s.index for s in shards.plan_shards(prompts, rs)]
    done = sum(shards.shard_done(out, i) for i in indices)
    get_run_logger().info("rejection sampling: %d prompts in %d shards (%d already written in %s)", len(prompts),
                          len(indices), done, out)
    tracking.log_params(run_id, {"rejection.shards": len(indices), "rejection.prompts": len(prompts)})
    return RejectionPlan(str(out), indices, prompts_uri, model_cfg.name_or_path, non_reasoning_uri)


def non_reasoning_rows(source: str, n: int, seed: int) -> pd.DataFrame:
    """`n` (prompt, response) rows without a verifiable answer: generated general requests, or a user file."""
    if source == "synthetic":
        from grpo.data.preferences import general_sft_rows

        return general_sft_rows(n, seed)
    rows = validate_rows(read_table(source), {"prompt": "text or chat messages", "response": "text"}, source)
    if len(rows) < n:
        raise ValueError(f"{source}: {len(rows)} non-reasoning rows, the recipe asks for {n}")
    return rows.iloc[:n].reset_index(drop=True)


_loaded: dict[str, tuple] = {}
_load_lock = threading.Lock()


def _policy(model_cfg: ModelConfig):
    """The sampled model, loaded once per process (shard tasks run in threads of one worker)."""
    key = model_cfg.model_dump_json()
    with _load_lock:
        if key not in _loaded:
            _loaded.clear()  # one model at a time
            model, tok = load_model_and_tokenizer(model_cfg)
            if torch.cuda.is_available():
                model = model.cuda()
            _loaded[key] = (model, tok)
        return _loaded[key]


@task(name="sample_shard", retries=1)
def sample_shard(plan: RejectionPlan, index: int, cfg: RejectionSamplingConfig) -> dict:
    """Sample and curate one shard and write its Parquet file; a shard already written is read back instead."""
    out = Path(plan.out_dir)
    if shards.shard_done(out, index):
        return shards.read_shard(out, index).counts.to_dict()
    model_cfg = cfg.model.model_copy(update={"name_or_path": plan.model_dir})
    model, tok = _policy(model_cfg)
    judge = None
    if cfg.judge is not None and cfg.rejection.judge_when != "never":
        judge = (build_judge(cfg.judge, model, tok) if cfg.judge.backend == "transformers"
                 and cfg.judge.model == SELF_JUDGE else build_judge(cfg.judge))
    prompts = read_frame(plan.prompts_uri).reset_index(drop=True)
    shard = shards.plan_shards(prompts, cfg.rejection)[index]
    result = shards.process_shard(TransformersBackend(model, tok), shards.rows_of_shard(prompts, shard),
                                     cfg.rejection, judge, index)
    shards.write_shard(result, out, index)
    c = result.counts
    get_run_logger().info("shard %d/%d: %d generated, %d kept", index + 1, len(plan.shards), c.generated, c.kept)
    return c.to_dict()


@task(name="merge_rejection_shards")
def merge_rejection_shards(run_id: str, plan: RejectionPlan, cfg: RejectionSamplingConfig,
                           heldout_uri: str | None) -> tuple[str, dict[str, float]]:
    """Merge the shard files into the curated dataset; log counts, the dataset and a sample table."""
    heldout = read_frame(heldout_uri) if heldout_uri else None
    non_reasoning = read_frame(plan.non_reasoning_uri) if plan.non_reasoning_uri else None
    result = shards.merge_shards(plan.out_dir, cfg.rejection, heldout, non_reasoning, num_shards=len(plan.shards))
    c = result.counts
    metrics = c.metrics()
    metrics["rejection/rows"] = float(len(result.dataset))
    metrics["rejection/non_reasoning_rows"] = float(result.non_reasoning)
    if c.judge_asked:
        metrics["rejection/judge_accept_rate"] = c.judge_accepted / c.judge_asked
    tracking.MetricsLogger(run_id)(0, metrics)
    data = result.dataset
    tracking.log_dataset(run_id, data, name="curated", source=f"runs:/{run_id}/dataset/curated", context="output")
    uri = tracking.log_frame(run_id, data, "dataset/curated")
    tracking.log_table(run_id, data.head(50).astype(str), "samples/curated_head.json")
    get_run_logger().info("rejection sampling: %s", summary_line(metrics))
    return uri, metrics
