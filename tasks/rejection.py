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

from grpo.configs.grading import SELF_JUDGE, JudgeConfig
from grpo.configs.model import ModelConfig
from grpo.configs.recipe import RejectionSamplingConfig
from grpo.configs.rejection import RejectionConfig
from grpo.data.row_files import describe_row_files
from grpo.data.tables import DataError
from grpo.interrupts import interruptible
from grpo.models import load_model_and_tokenizer, load_tokenizer
from grpo.rejection import shards
from grpo.rejection.budget import (
    Budget,
    format_budget,
    format_plan_against_run,
    judge_metrics,
    measure_tokens_per_s,
    plan_mean_fraction,
    plan_against_run,
    plan_budget,
)
from grpo.rejection.curate import HeldoutIndex, build_heldout_index
from grpo.rejection.filters import summary_line
from grpo.rejection.non_reasoning import MODEL, ModelAnswers, write_non_reasoning
from grpo.sampling.engines import Engine, build_engine, local_generation
from grpo.sampling.judge import HTTPJudge, build_judge
from runtime import dataset_refs, tracking
from runtime.cluster import check_cluster, ray_connected, shard_store_dir
from runtime.stage import resolve_model, work_dir, work_key
from tasks.data import read_frame



class RejectionPlan(NamedTuple):
    out_dir: str  # shard files live here (a local folder or a shard store URI), keyed by what decides their content
    shards: list[int]  # every shard index of the plan (written ones are skipped by the shard task)
    prompts_uri: str  # the validated prompt table
    model_dir: str  # local copy of the checkpoint; on Ray its URI, which each worker downloads itself
    non_reasoning_uri: str | None  # the non-reasoning rows to append (Parquet part files), if the config asks for any
    ray_address: str | None = None  # the cluster the shard tasks run on (checked reachable); None = threads here
    heldout_uri: str | None = None  # the held-out prompts each shard task decontaminates its rows against
    budget: Budget | None = None  # the plan printed before sampling; None without a throughput to plan time with
    shard_prompts: tuple[int, ...] = ()  # prompts in each shard, for the plan's prediction of its time


@task(name="plan_rejection_sampling")
def plan_rejection_sampling(run_id: str, checkpoint_uri: str, cfg: RejectionSamplingConfig,
                            prompts_uri: str, heldout_uri: str | None = None) -> RejectionPlan:
    """Check everything that can be checked before sampling (cluster, store, prompts, judge, non-reasoning rows)."""
    rs = cfg.rejection
    shard_keys = rs.model_dump(mode="json", exclude=set(shards.MERGE_ONLY_FIELDS))
    # served samples come from whatever model the servers serve: keyed by its name, not by the endpoints, so a
    # rerun with other (or more) servers resumes the same shards
    served = [{"backend": "http", "model": cfg.generation.model}] if cfg.generation.backend == "http" else []
    # likewise the judge: by what decides its verdicts, not by where it is or how hard it is asked, so a rerun
    # after a judge outage resumes the shards written, with the judge restarted at another address
    judge = cfg.judge.model_dump(mode="json", exclude=set(JUDGE_REACH_FIELDS)) if cfg.judge is not None else None
    keys = (checkpoint_uri, cfg.model, judge, shard_keys, cfg.data, *served)
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
    model_dir = checkpoint_uri if ray_address else resolve_model(cfg.model, checkpoint_uri).name_or_path
    non_reasoning_uri = None
    if rs.non_reasoning_rows:
        non_reasoning_uri = log_non_reasoning(run_id, cfg, rs.non_reasoning_rows, rs.seed)
    shards.check_manifest(out, prompts, rs)  # refuses to mix shards made from other prompts or settings
    planned = shards.plan_shards(prompts, rs)
    indices = [s.index for s in planned]
    done = sum(shards.shard_done(out, i) for i in indices)
    logger = get_run_logger()
    logger.info("rejection sampling: %d prompts in %d shards (%d already written in %s)", len(prompts),
                len(indices), done, out)
    tracking.log_params(run_id, {"rejection.shards": len(indices), "rejection.prompts": len(prompts)})
    budget = stage_budget(cfg, prompts, model_dir, ray_address)
    text = format_budget(budget, "the stage's prompt table") if budget else (
        "no throughput to plan time with: set budget.tokens_per_s (shards sampled locally on a Ray cluster)")
    logger.info("rejection sampling, the plan before sampling:\n%s", text)
    tracking.log_text(run_id, text + "\n", "plan/budget.txt")
    return RejectionPlan(out, indices, prompts_uri, model_dir, non_reasoning_uri, ray_address, heldout_uri, budget,
                         tuple(s.stop - s.start for s in planned))


# Judge settings that say where it is and how hard to ask it, not what it answers: they do not key the shards
JUDGE_REACH_FIELDS = ("base_url", "api_key_env", "timeout_s", "max_retries", "backoff_s", "max_workers")


def stage_budget(cfg: RejectionSamplingConfig, prompts: pd.DataFrame, model_dir: str,
                 ray_address: str | None) -> Budget | None:
    """The plan of sampling `prompts` under the recipe's `budget` assumptions; its throughput given, or measured
    now by a short real generation where it can be: from the recipe's endpoints, or with the checkpoint in this
    process when the shards sample here (which loads it once for them). None on a Ray cluster sampling locally
    without a given throughput: the driver does not load the model."""
    rs, b = cfg.rejection, cfg.budget
    http = cfg.generation.backend == "http"
    generators = b.generators or (len(cfg.generation.endpoints) if http else 1)
    tokens_per_s, how, probe = b.tokens_per_s, "given", None
    if tokens_per_s is None:
        if ray_address and not http:
            return None
        k = rs.samples_per_prompt
        texts = prompts["prompt"].tolist()
        model_cfg = cfg.model.model_copy(update={"name_or_path": model_dir})
        # servers: an engine of its own, so the shard tasks' shared one counts only their samples
        engine = (build_engine(cfg.generation, tokenizer=load_tokenizer(model_cfg), text_only_ok=True) if http
                  else _engine(cfg, model_cfg))
        batch = texts[:max(1, (cfg.generation.max_in_flight * generators if http else rs.sampling.batch_size) // k)]
        try:
            with shards.seeded_torch(rs.seed):  # the process's RNG as it was: the shards draw under their own seeds
                rate, tokens, seconds = measure_tokens_per_s(engine, batch, k, rs.sampling)
        finally:
            if http:
                engine.close()
        if http:
            rate /= generators
        probe = (tokens, len(batch) * k)
        tokens_per_s, how = rate, (f"measured: {tokens:,} tokens in {seconds:.1f} s, {len(batch) * k} samples"
                                   + (f" from {generators} endpoint(s), divided by them" if http else ", local"))
    mean_fraction, fraction_source = plan_mean_fraction(b.mean_fraction, rs.sampling, probe)
    return plan_budget(len(prompts), rs, mean_fraction=mean_fraction, keep_rate=b.keep_rate,
                       tokens_per_s=tokens_per_s, generators=generators, tokens_per_s_source=how,
                       mean_fraction_source=fraction_source)


def log_non_reasoning(run_id: str, cfg: RejectionSamplingConfig, n: int, seed: int) -> str:
    """The `n` non-reasoning rows (generated general requests, the base model's own answers to them, or a user
    file's first rows) written to Parquet part files a batch at a time, each batch checked as it is read, and logged
    as the run's `dataset/non_reasoning` folder with a record of it by reference and a sample table, as the curated
    dataset is; the folder's URI."""
    source, answers = cfg.non_reasoning_source, None
    if source == MODEL:  # the stage's base model (its `model`, not the RL checkpoint), sampled here
        logger = get_run_logger()
        answers = ModelAnswers(build_engine(local_generation(cfg.generation), *_policy(cfg.model),
                                            who="non-reasoning answers"),
                               cfg.rejection.samples_per_prompt,
                               cfg.non_reasoning_sampling or cfg.rejection.sampling, logger.info)
        logger.info("non-reasoning rows: %s answers the general requests itself (%d tries each)",
                              cfg.model.name_or_path, answers.samples)
    described = {"synthetic": f"synthetic:general_sft_rows(seed={seed})",
                 MODEL: f"model:{cfg.model.name_or_path}(seed={seed})"}.get(source, source)
    with tempfile.TemporaryDirectory(dir=tracking.r1_home(), prefix="non-reasoning-") as tmp:
        folder = Path(tmp) / "non_reasoning"
        with shards.seeded_torch(seed):
            write_non_reasoning(source, n, seed, folder, answers=answers)
        dataset = describe_row_files(folder)
        dataset_refs.log_dataset_reference(run_id, dataset, name="non_reasoning", context="input", source=described)
        dataset_refs.log_sample_table(run_id, dataset, "samples/non_reasoning_head.json")
        return tracking.log_dir(run_id, folder, "dataset/non_reasoning")


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
_judge_slots: dict[tuple, threading.BoundedSemaphore] = {}


def _in_flight(judge: JudgeConfig) -> threading.BoundedSemaphore:
    """The one bound on requests in flight to a judge endpoint, shared by this process's shard tasks."""
    key = (judge.base_url, judge.max_workers)
    with _load_lock:
        return _judge_slots.setdefault(key, threading.BoundedSemaphore(judge.max_workers))


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
                 else build_judge(cfg.judge, generation=local,
                                  in_flight=_in_flight(cfg.judge) if cfg.judge.backend == "http" else None))
    prompts = read_frame(plan.prompts_uri).reset_index(drop=True)
    shard = shards.plan_shards(prompts, cfg.rejection)[index]
    heldout = _heldout_index(plan.heldout_uri, cfg.rejection)  # decontaminated here, where the samples are
    with interruptible():  # a stopped stage stops its shards mid-sampling, not after them
        result = shards.process_shard(engine, shards.rows_of_shard(prompts, shard), cfg.rejection, judge, index,
                                      heldout)
    shards.write_shard(result, out, index)
    c, t = result.counts, result.timing
    given_up = [url for url, s in engine.stats().items() if s["dead"]] if cfg.generation.backend == "http" else []
    judged = f", judge {t.judge_calls} calls in {t.judge_s:.1f} s" if t.judge_calls else ""
    get_run_logger().info("shard %d/%d: %d generated in %.1f s, %d kept%s%s", index + 1, len(plan.shards),
                          c.generated, t.sample_s, c.kept, judged,
                          f" (generation endpoints given up so far: {given_up})" if given_up else "")
    return c.to_dict()


@task(name="merge_rejection_shards")
def merge_rejection_shards(run_id: str, plan: RejectionPlan, cfg: RejectionSamplingConfig,
                           heldout_uri: str | None) -> tuple[str, dict[str, float]]:
    """Merge the shard files into the curated dataset, streamed to Parquet part files; log the counts, the
    dataset's folder, its record by reference and a sample table."""
    heldout = read_frame(heldout_uri) if heldout_uri else None
    # the folder of part files, which the merge reads a batch at a time after the reasoning rows
    non_reasoning = tracking.download(plan.non_reasoning_uri) if plan.non_reasoning_uri else None
    # written here, then copied to the run's artifacts: the text in memory is `merge_batch_rows` rows' at a time
    with tempfile.TemporaryDirectory(dir=tracking.r1_home(), prefix="curated-") as tmp:
        if plan.ray_address:  # the shard files read on the cluster's nodes (Ray Data), decided and written here
            from grpo.rejection.ray_reader import RayDataReader

            reader = RayDataReader()
            with ray_connected(plan.ray_address):
                merged = shards.write_merged(plan.out_dir, cfg.rejection, Path(tmp) / "curated", heldout,
                                             non_reasoning, num_shards=len(plan.shards), reader=reader)
            get_run_logger().info("merge: the shard files read on %d node(s) of the cluster", len(reader.nodes))
        else:
            merged = shards.write_merged(plan.out_dir, cfg.rejection, Path(tmp) / "curated", heldout, non_reasoning,
                                         num_shards=len(plan.shards))
        c = merged.counts
        metrics = c.metrics()
        metrics["rejection/rows"] = float(merged.rows)
        metrics["rejection/non_reasoning_rows"] = float(merged.non_reasoning)
        if c.judge_asked:
            metrics["rejection/judge_accept_rate"] = c.judge_accepted / c.judge_asked
        log_metrics = tracking.MetricsLogger(run_id)
        # the plan against the run and the judge's rates: timings, logged on the stage's run, kept out of the
        # stage's figures (the pipeline's summary, which reruns and placements compare)
        compared = log_plan_against_run(run_id, plan, cfg, c.kept, log_metrics)
        log_metrics(0, {**metrics, **compared})
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


def log_plan_against_run(run_id: str, plan: RejectionPlan, cfg: RejectionSamplingConfig, kept: int,
                         log_metrics: tracking.MetricsLogger) -> dict[str, float]:
    """Each shard's predicted and measured sampling time (metrics `plan/predicted_s` and `plan/measured_s` at the
    shard's index as step, and the table `plan/shards.json`) and the stage's summary figures, which it returns:
    the plan's totals against the run's, and the judge's calls per second and per 1,000 kept rows."""
    timings = [shards.read_timing(plan.out_dir, i) for i in plan.shards]  # each shard's footer, no rows
    if plan.budget is None:
        calls = sum(t.judge_calls for t in timings if t)
        judge_s = sum(t.judge_s for t in timings if t)
        return judge_metrics(calls, judge_s, kept) if calls else {}
    rows, summary = plan_against_run(plan.budget, list(plan.shard_prompts), timings, kept,
                                     spread_over_generators=cfg.generation.backend == "http")
    for row in rows:
        if "measured_s" in row:
            log_metrics(row["shard"], {"plan/predicted_s": row["predicted_s"], "plan/measured_s": row["measured_s"]})
    tracking.log_table(run_id, pd.DataFrame(rows), "plan/shards.json")
    get_run_logger().info("rejection sampling, the plan against the run: %s", format_plan_against_run(summary))
    return summary
