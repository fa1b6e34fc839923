"""What every stage shares: its result record, its MLflow child run, its working folder, model resolution."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from grpo.configs.model import ModelConfig
from grpo.faults import check_free_space, disk_fault
from grpo.interrupts import interrupt_threads, is_interrupt
from runtime import system_metrics, tracking


class StageResult(BaseModel):
    """What a stage hands the next one: its MLflow run and the URIs it produced (never tensors or pickles)."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")  # a nan figure (nothing to measure) kept

    stage: str  # cold_start_sft, reasoning_grpo, rejection_sampling, sft, alignment_grpo
    run_id: str  # the stage's MLflow child run
    uris: dict[str, str]  # e.g. {"checkpoint": "runs:/<id>/checkpoint", "dataset": "runs:/<id>/dataset"}
    metrics: dict[str, float] = {}  # the stage's headline numbers (eval/accuracy, ...)


RESULT = "r1.result"  # tag on a stage's MLflow run: its StageResult as JSON (what the pipeline and a reuse read)


def record_result(result: StageResult, **tags: str) -> None:
    """Tag the stage's MLflow run with its result (and `tags`), all at once: a pipeline that placed the stage on
    another machine reads it from there. A result too long for a tag is logged as an error, not raised: the stage
    itself stands."""
    from mlflow.entities import RunTag
    from mlflow.exceptions import MlflowException

    try:
        tracking.client().log_batch(result.run_id, tags=[RunTag(RESULT, result.model_dump_json()),
                                                         *(RunTag(k, v) for k, v in tags.items())])
    except MlflowException as e:
        import logging

        logging.getLogger(__name__).error("%s: run %s cannot record its result: %s", result.stage, result.run_id, e)


def read_result(run) -> StageResult | None:
    """The StageResult an MLflow run records (None if it records none)."""
    text = run.data.tags.get(RESULT)
    return StageResult.model_validate_json(text) if text else None


class PipelineResult(BaseModel):
    """A pipeline run: its MLflow parent run and each stage's result, in order."""

    model_config = ConfigDict(frozen=True)

    run_id: str  # the MLflow parent run
    stages: dict[str, StageResult]


def prefect_tags() -> dict[str, str]:
    """The Prefect flow run this code runs in, as MLflow tags (empty outside a flow run)."""
    from prefect.runtime import flow_run

    tags = {}
    if flow_run.id:
        tags["prefect.flow_run_id"] = str(flow_run.id)
        tags["prefect.flow_run_name"] = str(flow_run.name)
        if flow_run.ui_url:
            tags["prefect.flow_run_url"] = str(flow_run.ui_url)
    return tags


def earlier_attempt_run() -> str | None:
    """On a Prefect retry of the current flow run (same id, run_count > 1): the MLflow run its first attempt made.

    Prefect retries a flow run by running its function again under the same flow run id, whether the flow has
    `retries` or someone pressed *Retry* in the UI; the run's `prefect.flow_run_id` tag finds what it made before.
    """
    from prefect.runtime import flow_run

    if not flow_run.id or flow_run.run_count <= 1:
        return None
    runs = [r for r in tracking.find_runs(f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
            if "stage" not in r.data.tags]  # a stage the pipeline reused is a child run in its flow run too
    return runs[-1].info.run_id if runs else None  # the oldest: the first attempt's


@contextmanager
def stage_run(stage: str, config: BaseModel, parent_run_id: str | None,
              inputs: dict[str, str] | None = None) -> Iterator[str]:
    """An MLflow child run tagged `stage=<stage>` with the config as params and system metrics
    (`runtime.system_metrics`); ended FAILED if the body raises, KILLED on Ctrl-C or SIGTERM (`grpo.interrupts`). Its
    work folders are unlocked when it ends.

    `inputs` (the upstream URIs) are logged as params and tags, so a run records what it was built from. A stage of
    a pipeline started fresh (`r1.fresh` on the parent) is tagged the same, and its work folders start empty.
    """
    inputs = inputs or {}
    check_free_space(tracking.r1_home())  # before the run's first write: a disk with no room is one line, not a 500
    fresh = {}
    if parent_run_id and tracking.client().get_run(parent_run_id).data.tags.get(FRESH) == "true":
        fresh = {FRESH: "true"}
    run_id = tracking.start_run(stage, tags={"stage": stage, **prefect_tags(), **fresh,
                                             **{f"input.{k}": v for k, v in inputs.items()}},
                                parent_run_id=parent_run_id, config=config)
    if inputs:
        tracking.log_params(run_id, {f"input.{k}": v for k, v in inputs.items()})
    monitor = system_metrics.start(run_id)
    try:
        yield run_id
    except BaseException as e:
        stopped = is_interrupt(e)
        if stopped:  # shard tasks in other threads stop too, so the flow's end does not wait for them
            interrupt_threads()
        try:
            if stopped:  # a stop has seconds: the run's end first, then its figures (to a run that has ended)
                try:
                    tracking.end_run_if_room(run_id, "KILLED")
                finally:
                    system_metrics.stop(monitor)
            else:
                try:
                    system_metrics.stop(monitor)
                finally:
                    tracking.end_run_if_room(run_id, "FAILED")
        finally:
            release_work_dirs(run_id)
        # a full disk under any of its writes (a checkpoint, a dataset, MLflow's SQLite) is told as one
        fault = None if stopped else disk_fault(e, [tracking.r1_home()])
        if fault is not None and fault is not e:
            raise fault from e
        raise
    try:  # ended before its folders are let go: a run that takes them over starts after this one's end
        system_metrics.stop(monitor)
        tracking.end_run(run_id, "FINISHED")
    finally:
        release_work_dirs(run_id)


def resolve_precision(run_id: str, section: str, cfg: BaseModel) -> BaseModel:
    """`cfg` with its `mixed_precision` resolved on this machine (`grpo.training.precision`), which is what the
    stage's loop, its launched processes and its work folder's key are given, so work trained in bf16 is never
    resumed by an fp32 run. Logged as `<section>.resolved_precision` and `<section>.precision_reason`."""
    from grpo.training.precision import resolve

    memory = getattr(cfg, "memory", None)  # GRPO keeps its precision in its memory section, the others at the top
    resolved = resolve((memory or cfg).mixed_precision)
    tracking.log_params(run_id, {f"{section}.resolved_precision": resolved.precision,
                                 f"{section}.precision_reason": resolved.reason})
    if memory is not None:
        return cfg.model_copy(update={"memory": memory.model_copy(update={"mixed_precision": resolved.precision})})
    return cfg.model_copy(update={"mixed_precision": resolved.precision})


def log_gemm_plan(run_id: str, section: str, out: Path) -> None:
    """The fp32 GEMM libraries the loop ran (grpo.kernels.gemm) and the rates it measured to choose them, as the
    stage run's parameters `<section>.fp32_gemm.*` (the loop wrote them to its work folder)."""
    from grpo.kernels.gemm import load_plan

    plan = load_plan(out)
    if plan is not None:  # a retried stage measured again: the run keeps its first attempt's figures
        logged = tracking.client().get_run(run_id).data.params
        tracking.log_params(run_id, {k: v for k, v in plan.params(section).items() if k not in logged})


def work_key(*keys) -> str:
    """A short hash of the stage's inputs: the name of its working folder, locally or in a shard store."""
    blob = json.dumps([k.model_dump(mode="json") if isinstance(k, BaseModel) else k for k in keys], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


FRESH = "r1.fresh"  # tag: the run starts over, reusing nothing and resuming from no checkpoint
_held: dict[str, dict[Path, int]] = {}  # stage run id -> the work folders it holds, each with its lock's descriptor
_held_lock = threading.Lock()


def work_dir(run_id: str, stage: str, *keys, root: Path | None = None) -> Path:
    """A working folder keyed by the stage's inputs, so a rerun with the same inputs finds (and resumes) its work.
    It lives under R1_HOME/work, or under `root` (a folder other machines mount: `launch.work_root`).

    The folder is locked for run `run_id` until its stage ends (an flock: a killed process lets go of it). A second
    run with the same inputs at the same time, two `r1 run` of one recipe say, gets a private folder instead of
    writing checkpoints into the first one's. A run started fresh finds its folder emptied.
    """
    shared = (root or tracking.r1_home() / "work") / stage / work_key(*keys)
    with _held_lock:
        held = _held.setdefault(run_id, {})
        for path in (shared, shared.with_name(f"{shared.name}-{run_id}")):
            if path in held:
                return path
            path.mkdir(parents=True, exist_ok=True)
            check_free_space(path)  # it may be a disk of its own
            fd = os.open(path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # in use by a live run
                os.close(fd)
                continue
            held[path] = fd
            if path == shared and tracking.client().get_run(run_id).data.tags.get(FRESH) == "true":
                for item in path.iterdir():
                    if item.name != ".lock":
                        shutil.rmtree(item) if item.is_dir() else item.unlink()
            # where its checkpoints are, and since when it holds the folder (it may have waited for another run)
            tracking.set_tags(run_id, {f"r1.work_dir.{stage}": str(path),
                                       f"r1.work_dir_since.{stage}": str(int(time.time() * 1000))})
            return path
    raise RuntimeError(f"cannot lock a work folder for run {run_id} under {shared.parent}")


def release_work_dirs(run_id: str) -> None:
    """Unlock the run's work folders; a private one (see `work_dir`) is deleted, as no later run can resume it."""
    with _held_lock:
        for path, fd in _held.pop(run_id, {}).items():
            if path.name.endswith(run_id):
                shutil.rmtree(path, ignore_errors=True)
            os.close(fd)


def resolve_model(cfg: ModelConfig, uri: str | None) -> ModelConfig:
    """The model config with `name_or_path` pointing at a local copy of `uri` (a checkpoint artifact), if given."""
    if uri is None:
        return cfg
    return cfg.model_copy(update={"name_or_path": str(tracking.download(uri))})
