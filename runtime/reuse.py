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
pipeline's own MLflow run either. The task that records a reuse is tasks/reuse.py's.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from runtime import tracking
from runtime.stage import RESULT, StageResult, record_result

KEY = "r1.stage_key"  # tag: what decides the stage's result (see stage_key)
REUSED_FROM = "r1.reused_from"  # tag on a reusing run: the run that did the work
CLI = Path(__file__).parents[1] / "flows" / "cli"


@lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of the project's code that computes results (grpo/, runtime/, tasks/, flows/ but its CLI) and of
    torch and transformers."""
    from importlib.metadata import version

    import grpo

    digest = hashlib.sha256(f"{version('torch')} {version('transformers')}".encode())
    root = Path(grpo.__file__).parents[1]
    for package in (root / "grpo", root / "runtime", root / "tasks", root / "flows"):
        for path in sorted(package.rglob("*.py")):
            if path.is_relative_to(CLI):  # the command line computes no result
                continue
            digest.update(str(path.relative_to(package.parent)).encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def _local_files(values) -> dict[str, list]:
    """(size, mtime) of the local files and folders named among `values`: a path's content may change, its name not."""
    found = {}
    for value in values:
        # an empty setting (`generation.model: ""`, say) names no file: read as a path it was the working folder, and
        # every file under it (a virtualenv's too) went into the key, which any write there then changed
        if not isinstance(value, str) or not value.strip() or "://" in value or value.startswith(("runs:", "models:")):
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
    precision its loops resolve to (`auto` is bf16 on one machine and fp32 on another: not the same work).

    Where the stage runs is not part of it (`resources`), but decides the precision: in process it is resolved
    here; a stage placed on a pool resolves on that pool's machines, which this process cannot ask, so the pool
    stands for it (work placed on a GPU pool is not reused by a run on this CPU, nor the other way round).
    """
    from grpo.training.precision import resolve_config

    flat = {k: v for k, v in tracking.flatten(config).items() if not k.startswith("resources.")}
    pool = getattr(getattr(config, "resources", None), "pool", None)
    precision = {"pool": pool} if pool else {path: r.precision for path, r in resolve_config(config).items()}
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
    record_result(result, **{KEY: key})
