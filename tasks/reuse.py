"""Reusing a stage that already finished with the same config and inputs, found in MLflow by a key.

Every stage run the pipeline finishes is tagged `r1.stage_key`: a digest of the stage's name, its config, its input
URIs, the size and time of any local file the config or inputs name, the project's code, and the precision its
training loops resolve to. A later pipeline run
whose stage has the same key reuses that run: it records a new child run (tagged `r1.reused_from`, holding the same
URIs and headline metrics) instead of training again. Input URIs name the upstream runs, so a reused upstream stage
keeps the downstream keys equal and the whole chain is reused; a changed stage changes its outputs' URIs and so
reruns everything after it.

Why MLflow rather than Prefect's cache (cache_policy=INPUTS with persisted results): the key must find MLflow runs,
and MLflow is where they live. Prefect's cache records sit in its result store (a local folder by default, beside
the temporary API), not in the tracking server a team shares, so a cache hit could hand back `runs:/` URIs of
another tracking store, or of runs deleted since; a lookup among the experiment's FINISHED runs cannot. Prefect
caches tasks, while a stage is a subflow, and a cache hit runs nothing, so it could not record the reuse in the
pipeline's own MLflow run either.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from prefect import task
from prefect.logging import get_run_logger
from pydantic import BaseModel

from tasks import tracking
from tasks.stage import StageResult, stage_run

KEY = "r1.stage_key"  # tag: what decides the stage's result (see stage_key)
RESULT = "r1.result"  # tag: the stage's StageResult as JSON, what a reuse hands on
REUSED_FROM = "r1.reused_from"  # tag on a reusing run: the run that did the work


@lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of the project's code that computes results (grpo/, tasks/, flows/) and of torch and transformers."""
    from importlib.metadata import version

    import grpo

    digest = hashlib.sha256(f"{version('torch')} {version('transformers')}".encode())
    for package in (Path(grpo.__file__).parent, Path(__file__).parent, Path(__file__).parents[1] / "flows"):
        for path in sorted(package.rglob("*.py")):
            digest.update(str(path.relative_to(package.parent)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _local_files(values) -> dict[str, list]:
    """(size, mtime) of the local files and folders named among `values`: a path's content may change, its name not."""
    found = {}
    for value in values:
        if not isinstance(value, str) or "://" in value or value.startswith(("runs:", "models:")):
            continue
        path = Path(value).expanduser()
        if path.is_file():
            found[value] = [path.stat().st_size, path.stat().st_mtime_ns]
        elif path.is_dir():
            found[value] = sorted([str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns]
                                  for p in path.rglob("*") if p.is_file())
    return found


def stage_key(stage: str, config: BaseModel, inputs: dict[str, str]) -> str:
    """What decides a stage's result: its name, config, input URIs, the local files they name, the code, and the
    precision its loops resolve to here (`auto` is bf16 on one machine and fp32 on another: not the same work)."""
    from grpo.training.precision import resolve_config

    flat = tracking.flatten(config)
    precision = {path: r.precision for path, r in resolve_config(config).items()}
    blob = json.dumps({"stage": stage, "config": flat, "inputs": inputs, "code": code_version(),
                       "files": _local_files([*flat.values(), *inputs.values()]), "precision": precision},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def find_finished(key: str):
    """The newest FINISHED run recorded with this stage key, or None (a deleted run is never found)."""
    runs = tracking.find_runs(f"tags.`{KEY}` = '{key}' and attributes.status = 'FINISHED'")
    return next((r for r in runs if RESULT in r.data.tags), None)


def record_finished(result: StageResult, key: str) -> None:
    """Tag a finished stage run with its key and result, which makes it reusable (both at once, or neither)."""
    from mlflow.entities import RunTag
    from mlflow.exceptions import MlflowException

    try:
        tracking.client().log_batch(result.run_id, tags=[RunTag(KEY, key), RunTag(RESULT, result.model_dump_json())])
    except MlflowException as e:  # a result too long for a tag, say: the stage stands, it just cannot be reused
        get_run_logger().warning("%s: run %s cannot be recorded for reuse: %s", result.stage, result.run_id, e)


@task(name="reuse_stage", task_run_name="reuse {stage}")
def reuse_stage(stage: str, config: BaseModel, inputs: dict[str, str], key: str, earlier_run_id: str,
                parent_run_id: str) -> StageResult:
    """Record an earlier run's result as this pipeline's stage: a child run with the same config, inputs, URIs and
    headline metrics, tagged `r1.reused_from` with the run that did the work."""
    earlier = tracking.client().get_run(earlier_run_id)
    source = earlier.data.tags.get(REUSED_FROM, earlier_run_id)  # a reuse of a reuse points at the work itself
    done = StageResult.model_validate_json(earlier.data.tags[RESULT])
    with stage_run(stage, config, parent_run_id, inputs) as run_id:
        tracking.set_tags(run_id, {REUSED_FROM: source})
        tracking.MetricsLogger(run_id)(0, done.metrics)
        result = StageResult(stage=stage, run_id=run_id, uris=done.uris, metrics=done.metrics)
        record_finished(result, key)
    get_run_logger().info("%s: reusing MLflow run %s (same config and inputs)", stage, source)
    return result
