"""A stage's training loop on a Ray cluster: Ray Train workers (`distributed.engine: ray`).

The stage's task writes the same job file a local launch runs, in its work folder under `distributed.shared_dir` (a
folder every node and the task's machine mount), and hands it to a `TorchTrainer` of `num_workers` workers, spread
over the cluster's nodes (`ScalingConfig`: one GPU each where the cluster has GPUs). Ray Train starts the process
group (gloo on CPU, NCCL on GPU, under `collective_timeout_s`) and the environment accelerate reads, so each worker
runs `grpo.training.launchers.worker.run_job` exactly as a launched process does: the same loops, the same strategy (ddp or
fsdp), checkpoints in the shared work folder. Rank 0 appends its metrics to the events file there, which the task
follows while `fit` runs, as it follows a local launch.

When a worker or its node dies, Ray Train starts the worker group again (up to `max_failures` times) and the loop
resumes from the newest whole checkpoint in the shared folder; steps reported again after a restart are passed on
once only. Must not depend on Prefect or MLflow; ray is imported only here, only when a stage asks for it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable

from grpo.configs.distributed import DistributedConfig

# what a worker process needs beside the job file: the collectives' timeout, offline hubs
_PASSED_ENV = ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "R1_CPU_BF16")
log = logging.getLogger(__name__)


def check_ray_cluster(cfg: DistributedConfig, address: str) -> None:
    """Fail in one line, before any training, where the cluster cannot give the stage its workers."""
    import ray

    _connect(address)
    resources = ray.cluster_resources()
    gpus, cpus = resources.get("GPU", 0), resources.get("CPU", 0)
    if gpus and cfg.num_workers > gpus:
        raise ValueError(f"distributed.num_workers={cfg.num_workers}: the Ray cluster at {address} has {gpus:g} "
                         f"GPUs, one a worker; lower num_workers or add GPU nodes")
    if not gpus and cfg.num_workers > cpus:
        raise ValueError(f"distributed.num_workers={cfg.num_workers}: the Ray cluster at {address} has {cpus:g} "
                         f"CPUs and no GPU, one CPU a worker; lower num_workers or add nodes")


def share_inputs(job, folder: Path):
    """The job (`grpo.training.jobs`) with its local input folders (the model, a reward model, a process
    reward model, the reward model's base) copied under `folder`, in the shared work folder, where every node reads
    them; a hub name or a folder already there stays."""
    import shutil

    def shared(path: str | None, name: str) -> str | None:
        if not path or not Path(path).is_dir() or Path(path).resolve().is_relative_to(folder.parent.parent.resolve()):
            return path
        target = folder / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(path, target)
        return str(target)

    update = {}
    if getattr(job, "model", None) is not None:
        update["model"] = job.model.model_copy(update={"name_or_path": shared(job.model.name_or_path, "model")})
    base = getattr(job.cfg, "model", None)  # the reward model's base
    if base is not None and hasattr(base, "name_or_path"):
        update["cfg"] = job.cfg.model_copy(update={"model": base.model_copy(
            update={"name_or_path": shared(base.name_or_path, "base")})})
    if getattr(job, "prm", None):
        update["prm"] = shared(job.prm, "prm")
    if getattr(job, "reward_models", None):
        update["reward_models"] = {name: shared(path, name) for name, path in job.reward_models.items()}
    return job.model_copy(update=update)


def _connect(address: str) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)


def run_on_ray(address: str, cfg: DistributedConfig, job_file: Path, events: Path, result: Path,
               follow: Callable[[Callable[[], bool]], None]) -> None:
    """Train the job on the cluster; `follow(done)` hands the events on until `done()` (the fit ended) is true.
    Raises with Ray Train's error when the workers failed more than `max_failures` times."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    _connect(address)
    gpus = ray.cluster_resources().get("GPU", 0)
    env = {k: os.environ[k] for k in _PASSED_ENV if k in os.environ}
    trainer = TorchTrainer(
        _worker_loop, train_loop_config={"job_file": str(job_file)},
        torch_config=TorchConfig(backend="nccl" if gpus else "gloo", timeout_s=int(cfg.collective_timeout_s)),
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=bool(gpus), placement_strategy="SPREAD"),
        run_config=RunConfig(name=f"r1-{job_file.parent.parent.name}", storage_path=str(Path(cfg.shared_dir) / "ray"),
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             worker_runtime_env={"env_vars": env}))
    failure: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
            failure.append(e)

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    try:
        follow(lambda: not thread.is_alive())
    except BaseException:  # Ctrl-C, a stop signal: the workers must not train on without the stage
        ray.shutdown()  # this driver's job ends, and Ray Train's controller and workers, which it owns, with it
        raise
    thread.join()
    if failure:
        raise RuntimeError(f"training on Ray Train ({cfg.num_workers} workers at {address}) failed: "
                           f"{failure[0]}") from failure[0]
    if not result.exists():
        raise RuntimeError(f"training on Ray Train ended without a result ({result} is missing)")
    restarts = len(worker_starts(job_file)) // cfg.num_workers - 1
    if restarts > 0:
        log.warning("Ray Train started the workers again %d time(s) after a failure; each resumed from the newest "
                    "whole checkpoint", restarts)


WORKERS_LOG = "workers.jsonl"  # beside the job file: a line each time a worker starts (rank, node, pid, time)


def worker_starts(job_file: Path) -> list[dict]:
    """Every start of a worker of this job, in order: a rank seen twice was started again after a failure."""
    path = Path(job_file).parent / WORKERS_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _worker_loop(config: dict) -> None:
    """What each Ray Train worker runs: the job's loop, as a launched process runs it."""
    import time

    import ray.train

    from grpo.training.jobs import read_launched
    from grpo.training.launchers.worker import run_job

    job_file = Path(config["job_file"])
    context = ray.train.get_context()
    with (job_file.parent / WORKERS_LOG).open("a") as f:  # one short line: appends from several nodes stay whole
        f.write(json.dumps({"rank": context.get_world_rank(), "node": context.get_node_rank(), "pid": os.getpid(),
                            "time": time.time()}) + "\n")
    run_job(read_launched(job_file.read_text()))
