"""Tasks: rejection sampling in shards (one Prefect task per shard, one Parquet file each), then the merge."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
from prefect import task
from prefect.logging import get_run_logger

from grpo.configs.core import SELF_JUDGE, ModelConfig, RejectionConfig
from grpo.configs.recipe import RejectionSamplingConfig
from grpo.data.row_files import describe_row_files
from grpo.data.tables import DataError, read_table, validate_rows
from grpo.interrupts import interruptible
from grpo.models import load_model_and_tokenizer, load_tokenizer
from grpo.rejection import shards
from grpo.rejection.curate import HeldoutIndex, build_heldout_index
from grpo.rejection.filters import summary_line
from grpo.sampling.engines import Engine, build_engine, local_generation
from grpo.sampling.judge import HTTPJudge, build_judge
from runtime import dataset_refs, tracking
from runtime.cluster import check_cluster, shard_store_dir
from runtime.stage import resolve_model, work_dir, work_key
from tasks.data import read_frame



class RejectionPlan(NamedTuple):
    out_dir: str  # shard files live here (a local folder or a shard store URI), keyed by what decides their content
    shards: list[int]  # every shard index of the plan (written ones are skipped by the shard task)
    prompts_uri: str  # the validated prompt table
    model_dir: str  # local copy of the checkpoint; on Ray its URI, which each worker downloads itself
    non_reasoning_uri: str | None  # the non-reasoning rows to append, if the config asks for any
    ray_address: str | None = None  # the cluster the shard tasks run on (checked reachable); None = threads here
    heldout_uri: str | None = None  # the held-out prompts each shard task decontaminates its rows against


@task(name="plan_rejection_sampling")
def plan_rejection_sampling(run_id: str, checkpoint_uri: str, cfg: RejectionSamplingConfig,
                            prompts_uri: str, heldout_uri: str | None = None) -> RejectionPlan:
    """Check everything that can be checked before sampling (cluster, store, prompts, judge, non-reasoning rows)."""
    rs = cfg.rejection
    shard_keys = rs.model_dump(mode="json", exclude=set(shards.MERGE_ONLY_FIELDS))
    # served samples come from whatever model the servers serve: keyed by its name, not by the endpoints, so a
    # rerun with other (or more) servers resumes the same shards
    served = [{"backend": "http", "model": cfg.generation.model}] if cfg.generation.backend == "http" else []
    keys = (checkpoint_uri, cfg.model, cfg.judge, shard_keys, cfg.data, *served)
    store = cfg.cluster.shard_store
    out = shard_store_dir(store, "rejection_sampling", work_key(*keys)) if store else str(
        work_dir(run_id, "rejection_sampling", *keys))
    ray_address = None
    if cfg.cluster.ray_address:  # an unreachable cluster or unwritable store fails here, before any shard
        ray_address = check_cluster(cfg.cluster, checkpoint_uri, out)
    elif store:
        shards.check_writable(out)
    judge_cfg = cfg.judge
    if judge_cfg is not None and judge_cfg.backend == "http" and rs.judge_when != "never":
        HTTPJudge(judge_cfg).check_available()  # a down endpoint fails the stage now, before any shard is sampled
    if cfg.generation.backend == "http":  # the same for the generation servers: each up and serving the model
        servers = build_engine(cfg.generation, text_only_ok=True)
        try:
            servers.check_available(rs.sampling)
        finally:
            servers.close()
    # only whether there will be a judge matters here; the shard tasks build it
    will_judge = judge_cfg if judge_cfg is not None and rs.judge_when != "never" else None
    prompts = shards.validate_prompts(read_frame(prompts_uri).reset_index(drop=True), rs, will_judge,
                                         source=prompts_uri)
    non_reasoning_uri = None
    if rs.non_reasoning_rows:
        rows = non_reasoning_rows(cfg.non_reasoning_source, rs.non_reasoning_rows, rs.seed)
        non_reasoning_uri = tracking.log_frame(run_id, rows, "dataset/non_reasoning")
    model_dir = checkpoint_uri if ray_address else resolve_model(cfg.model, checkpoint_uri).name_or_path
    shards.check_manifest(out, prompts, rs)  # refuses to mix shards made from other prompts or settings
    indices = [s.index for s in shards.plan_shards(prompts, rs)]
    done = sum(shards.shard_done(out, i) for i in indices)
    get_run_logger().info("rejection sampling: %d prompts in %d shards (%d already written in %s)", len(prompts),
                          len(indices), done, out)
    tracking.log_params(run_id, {"rejection.shards": len(indices), "rejection.prompts": len(prompts)})
    return RejectionPlan(out, indices, prompts_uri, model_dir, non_reasoning_uri, ray_address, heldout_uri)


def non_reasoning_rows(source: str, n: int, seed: int) -> pd.DataFrame:
    """`n` (prompt, response) rows without a verifiable answer: generated general requests, or a user file."""
    if source == "synthetic":
        from grpo.data.general import general_sft_rows

        return general_sft_rows(n, seed)
    rows = validate_rows(read_table(source), {"prompt": "text or chat messages", "response": "text"}, source)
    if len(rows) < n:
        raise ValueError(f"{source}: {len(rows)} non-reasoning rows, the recipe asks for {n}")
    return rows.iloc[:n].reset_index(drop=True)


_loaded: dict[str, tuple] = {}
_load_lock = threading.Lock()


def _policy(model_cfg: ModelConfig):
    """The sampled model, loaded once per process (shard tasks run in threads of one worker, or on Ray workers).

    A checkpoint URI (Ray) is downloaded into this worker's own temporary folder: nothing of the driver's is read.
    """
    key = model_cfg.model_dump_json()
    with _load_lock:
        if key not in _loaded:
            _loaded.clear()  # one model at a time
            if model_cfg.name_or_path.startswith(("runs:", "models:")) or "://" in model_cfg.name_or_path:
                local = tracking.download(model_cfg.name_or_path, tempfile.mkdtemp(prefix="r1-checkpoint-"))
                model_cfg = model_cfg.model_copy(update={"name_or_path": str(local)})
            model, tok = load_model_and_tokenizer(model_cfg)
            if torch.cuda.is_available():
                model = model.cuda()
            _loaded[key] = (model, tok)
        return _loaded[key]


_servers: dict[str, Engine] = {}
_heldout: dict[tuple, HeldoutIndex] = {}


def _heldout_index(uri: str | None, cfg: RejectionConfig) -> HeldoutIndex | None:
    """The held-out prompts' n-gram index, built once per process (shard tasks share a worker's threads)."""
    if uri is None or not cfg.decontamination_ngram:
        return None
    key = (uri, cfg.decontamination_ngram, cfg.decontamination_threshold)
    with _load_lock:
        if key not in _heldout:
            _heldout.clear()
            _heldout[key] = build_heldout_index(read_frame(uri)["prompt"].tolist(), *key[1:])
        return _heldout[key]


def _engine(cfg: RejectionSamplingConfig, model_cfg: ModelConfig) -> Engine:
    """The stage's engine: the checkpoint in this process, or the recipe's servers.

    One HTTP engine per process, so the bound on requests in flight per endpoint holds across shard tasks.
    """
    if cfg.generation.backend == "local":
        return build_engine(cfg.generation, *_policy(model_cfg), who="rejection sampling")
    key = f"{cfg.generation.model_dump_json()} {model_cfg.name_or_path}"
    with _load_lock:
        if key not in _servers:
            for old in _servers.values():
                old.close()
            _servers.clear()
            _servers[key] = build_engine(cfg.generation, tokenizer=load_tokenizer(model_cfg), text_only_ok=True)
        return _servers[key]


@task(name="sample_shard", retries=1)
def sample_shard(plan: RejectionPlan, index: int, cfg: RejectionSamplingConfig) -> dict:
    """Sample and curate one shard and write its Parquet file; a shard already written is read back instead."""
    out = plan.out_dir
    if shards.shard_done(out, index):
        return shards.read_shard(out, index).counts.to_dict()
    model_cfg = cfg.model.model_copy(update={"name_or_path": plan.model_dir})
    engine = _engine(cfg, model_cfg)
    judge = None
    if cfg.judge is not None and cfg.rejection.judge_when != "never":
        local = local_generation(cfg.generation)  # a local judge samples as the stage does
        judge = (build_judge(cfg.judge, *_policy(model_cfg), generation=local)
                 if cfg.judge.backend == "transformers" and cfg.judge.model == SELF_JUDGE
                 else build_judge(cfg.judge, generation=local))
    prompts = read_frame(plan.prompts_uri).reset_index(drop=True)
    shard = shards.plan_shards(prompts, cfg.rejection)[index]
    heldout = _heldout_index(plan.heldout_uri, cfg.rejection)  # decontaminated here, where the samples are
    with interruptible():  # a stopped stage stops its shards mid-sampling, not after them
        result = shards.process_shard(engine, shards.rows_of_shard(prompts, shard), cfg.rejection, judge, index,
                                      heldout)
    shards.write_shard(result, out, index)
    c = result.counts
    given_up = [url for url, s in engine.stats().items() if s["dead"]] if cfg.generation.backend == "http" else []
    get_run_logger().info("shard %d/%d: %d generated, %d kept%s", index + 1, len(plan.shards), c.generated, c.kept,
                          f" (generation endpoints given up so far: {given_up})" if given_up else "")
    return c.to_dict()


@task(name="merge_rejection_shards")
def merge_rejection_shards(run_id: str, plan: RejectionPlan, cfg: RejectionSamplingConfig,
                           heldout_uri: str | None) -> tuple[str, dict[str, float]]:
    """Merge the shard files into the curated dataset, streamed to Parquet part files; log the counts, the
    dataset's folder, its record by reference and a sample table."""
    heldout = read_frame(heldout_uri) if heldout_uri else None
    non_reasoning = read_frame(plan.non_reasoning_uri) if plan.non_reasoning_uri else None
    # written here, then copied to the run's artifacts: the text in memory is `merge_batch_rows` rows' at a time
    with tempfile.TemporaryDirectory(dir=tracking.r1_home(), prefix="curated-") as tmp:
        merged = shards.write_merged(plan.out_dir, cfg.rejection, Path(tmp) / "curated", heldout, non_reasoning,
                                     num_shards=len(plan.shards))
        c = merged.counts
        metrics = c.metrics()
        metrics["rejection/rows"] = float(merged.rows)
        metrics["rejection/non_reasoning_rows"] = float(merged.non_reasoning)
        if c.judge_asked:
            metrics["rejection/judge_accept_rate"] = c.judge_accepted / c.judge_asked
        tracking.MetricsLogger(run_id)(0, metrics)
        if not merged.rows:  # the counts are logged; the shards stay in the store for a rerun with other filters
            raise DataError(f"rejection sampling kept no rows ({summary_line(metrics)}): the SFT stage would have "
                            "nothing to train on; loosen the `rejection` filters, sample more per prompt, or check "
                            "the checkpoint it sampled from")
        uri = f"runs:/{run_id}/dataset/curated"
        dataset = describe_row_files(Path(tmp) / "curated")
        dataset_refs.log_dataset_reference(run_id, dataset, name="curated", source=uri, context="output")
        dataset_refs.log_sample_table(run_id, dataset, "samples/curated_head.json")
        tracking.log_dir(run_id, Path(tmp) / "curated", "dataset/curated")
    get_run_logger().info("rejection sampling: %s", summary_line(metrics))
    return uri, metrics
