"""A stage's training loop across processes: `accelerate launch` of `grpo.training.launchers.worker`, its reports logged here.

A stage whose recipe section sets `distributed.num_processes` above 1 (or an accelerate config file) does not
train in the Prefect task's own process: the task resolves every input to a local file, writes a job file in its
work folder and runs `accelerate launch --num_processes N -m grpo.training.launchers.worker <job file>` as a subprocess (DDP:
accelerate picks gloo on CPU and NCCL on GPU). The main process of the launch appends its metrics and sample tables
to an events file; this module follows that file while the children run and hands each line to the stage's
callbacks (MLflow metrics, the Prefect progress artifact), so the task's process is the only one that talks to
MLflow. The children's output goes to `launch.log` beside the job file; a failed launch raises with its tail.

With `distributed.num_machines` above 1 the launch spans machines (the pods of one multi-pod job, every one
mounting R1_HOME and R1_JOIN_DIR from shared storage): the stage's task runs on machine 0 and starts its share of
the processes, and announces the job file in R1_JOIN_DIR; each other machine runs `python -m grpo.training.launchers.join`,
which waits for that announcement and starts its own share with its machine rank. R1_MACHINE_RANK (0 where the task
runs), R1_MAIN_PROCESS_IP (machine 0's address) and R1_MAIN_PROCESS_PORT (29500 by default) come from the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pandas as pd

from grpo import cores
from grpo.configs.distributed import COLLECTIVE_TIMEOUT, DistributedConfig
from grpo.ports import free_port
from grpo.training.jobs import Job, Launched, MetricsCallback, SamplesCallback

# what a multi-machine job tells each of its machines (docs/distributed.md)
MACHINE_RANK, MAIN_IP, MAIN_PORT, JOIN_DIR = ("R1_MACHINE_RANK", "R1_MAIN_PROCESS_IP", "R1_MAIN_PROCESS_PORT",
                                              "R1_JOIN_DIR")
ANNOUNCEMENT = "job.json"  # in R1_JOIN_DIR: where machine 0's launch tells the others which job file to run
PROJECT_ROOT = Path(__file__).resolve().parents[3]  # where `-m grpo.training.launchers.worker` is importable from

def num_processes(cfg: DistributedConfig) -> int:
    """The recipe's process count on this machine ("auto": one per visible GPU, 1 without); refused if it cannot run."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = max(gpus, 1) if cfg.num_processes == "auto" else cfg.num_processes
    if gpus and n > gpus:  # NCCL wants a GPU of its own per process
        raise ValueError(f"distributed.num_processes={n}: this machine shows {gpus} GPU(s), and each process needs "
                         f"one; lower it, or use \"auto\" for one process per GPU")
    return n


def world_size(cfg: DistributedConfig) -> int:
    """The processes of every machine together (the Ray Train workers with engine ray)."""
    if cfg.engine == "ray":
        return cfg.num_workers
    return num_processes(cfg) * cfg.num_machines


def is_launched(cfg: DistributedConfig) -> bool:
    """Whether the stage's loops run in launched processes (else in the task's own, as one process)."""
    return world_size(cfg) > 1 or cfg.config_file is not None or cfg.engine == "ray"


def work_root(cfg: DistributedConfig) -> Path | None:
    """Where the stage's work folder goes when it must be somewhere else than this machine's R1_HOME: under the
    shared folder every Ray node mounts (engine ray); None otherwise."""
    return Path(cfg.shared_dir) / "work" if cfg.engine == "ray" else None


def check_splits(cfg: DistributedConfig, **sizes: int) -> int:
    """The process count of all machines, once every global batch size in `sizes` (field name -> size) splits
    evenly across it."""
    from grpo.configs.checks import check_process_split

    n = world_size(cfg)
    for field, size in sizes.items():
        check_process_split(field.replace("__", "."), size, n)
    if cfg.num_machines > 1:  # what the job must tell this machine, before any model loads
        machine(cfg)
        join_dir()
    return n


def resume_key(cfg: DistributedConfig) -> tuple:
    """What of the `distributed` section a stage's work folder (its resume checkpoints) is keyed by. Sharded
    checkpoints load on any process count, so under fsdp only the strategy counts: a stage killed on two processes
    resumes on one and the other way round. Under ddp the section counts where it launches processes."""
    if cfg.strategy == "fsdp":
        return ("fsdp",)
    return (cfg,) if is_launched(cfg) else ()


def config_file_path(name: str) -> Path:
    """An accelerate config file as given, or relative to the project; refused where it shards the model itself
    (accelerate's FSDP or DeepSpeed): the loops shard through `distributed.strategy`, which also gathers GRPO's
    sampler copy and the final checkpoint."""
    import yaml

    path = Path(name)
    path = path if path.is_absolute() or path.exists() else PROJECT_ROOT / path
    if not path.is_file():
        raise FileNotFoundError(f"distributed.config_file: no accelerate config file {name!r} (looked in the current "
                                f"folder and the project's)")
    kind = str((yaml.safe_load(path.read_text()) or {}).get("distributed_type", "")).upper()
    if kind in ("FSDP", "DEEPSPEED"):
        raise ValueError(f"distributed.config_file {name!r} sets distributed_type {kind}: the training loops shard "
                         f"through distributed.strategy; set strategy: fsdp and drop the config file")
    return path


def machine(cfg: DistributedConfig) -> tuple[int, str, int | None]:
    """(machine rank, main process address, port) of this machine: the job's settings where the launch spans
    machines (one-line errors for what is missing or wrong), this machine on a free port otherwise (None)."""
    if cfg.num_machines == 1:
        return 0, "127.0.0.1", None
    rank = os.environ.get(MACHINE_RANK, "0")
    if not rank.isdigit() or int(rank) >= cfg.num_machines:
        raise ValueError(f"{MACHINE_RANK}={rank!r}: expected a machine rank from 0 to {cfg.num_machines - 1} "
                         f"(distributed.num_machines={cfg.num_machines})")
    port = os.environ.get(MAIN_PORT, "29500")
    if not port.isdigit():
        raise ValueError(f"{MAIN_PORT}={port!r}: expected the port machine 0 listens on for the rendezvous")
    address = os.environ.get(MAIN_IP)
    if not address:
        raise ValueError(f"distributed.num_machines={cfg.num_machines}: {MAIN_IP} must name machine 0's address "
                         f"(the job sets it for every machine)")
    return int(rank), address, int(port)


def launch_command(cfg: DistributedConfig, n: int, job_file: Path, port: int) -> list[str]:
    """The `accelerate launch` command line that runs the job on `n` processes of this machine (and as many on each
    of the job's other machines, where it spans several)."""
    rank, address, main_port = machine(cfg)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n * cfg.num_machines),
           "--num_machines", str(cfg.num_machines), "--machine_rank", str(rank), "--main_process_ip", address,
           "--main_process_port", str(main_port or port)]
    if cfg.config_file:
        cmd += ["--config_file", str(config_file_path(cfg.config_file))]
    else:
        # accelerate's flag for its torchrun launcher: N processes on this machine. The children's Accelerator
        # then takes NCCL with a GPU each, or gloo on CPU (make_accelerator passes cpu=True where there is no GPU)
        cmd += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return cmd + ["-m", "grpo.training.launchers.worker", str(job_file)]


def run_launched(job: Job, on_metrics: MetricsCallback | None, on_samples: SamplesCallback | None = None,
                 ray_address: str | None = None) -> dict:
    """Run the job (`grpo.training.jobs`) across the processes its `distributed` section asks for; return
    what its main process reported.

    The job's input tables are copied beside the job file, in its work folder (where every process of the job reads:
    a multi-pod job's machines mount it), and the job is written with where to report as one document
    (`jobs.Launched`). Blocks until the launch ends; metrics and sample tables reach the callbacks as the main
    process writes them. With engine ray the workers run on the cluster at `ray_address` (resolved and checked by
    the caller) and the work folder is in the shared folder they all mount.
    """
    cfg = job.distributed
    n = num_processes(cfg)
    folder = Path(job.output_dir) / "launch"
    folder.mkdir(parents=True, exist_ok=True)
    events, result, log = folder / "events.jsonl", folder / "result.json", folder / "launch.log"
    for stale in (events, result):
        stale.unlink(missing_ok=True)
    job = _inputs_beside(job, folder)
    if cfg.engine == "ray":
        from grpo.training.launchers import ray_train

        job = ray_train.share_inputs(job, folder / "inputs")  # the nodes read only the shared folder
    job_file = folder / "job.json"
    job_file.write_text(Launched(job=job, events=str(events), result=str(result)).model_dump_json(indent=1))
    if cfg.engine == "ray":
        ray_train.run_on_ray(ray_address, cfg, job_file, events, result,
                             lambda ended: _follow(ended, events, on_metrics, on_samples))
        return json.loads(result.read_text())
    cmd = launch_command(cfg, n, job_file, free_port())
    if cfg.num_machines > 1:
        announce(job_file)
    try:
        return _run(cmd, world_size(cfg), events, result, log, cfg, on_metrics, on_samples)
    finally:
        if cfg.num_machines > 1:  # a machine joining later must not start a finished job
            (join_dir() / ANNOUNCEMENT).unlink(missing_ok=True)


def _inputs_beside(job: Job, folder: Path) -> Job:
    """The job with its input tables copied under `folder` (one that is there already stays)."""
    import shutil

    def beside(path: str, target: Path) -> str:
        if Path(path).resolve().is_relative_to(folder.resolve()):
            return path
        if Path(path).is_dir():  # an MLflow artifact folder of Parquet parts
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(path, target)
        else:
            shutil.copyfile(path, target)
        return str(target)

    moved = {}
    for name in job.INPUTS:
        path = getattr(job, name)
        if isinstance(path, list):  # several tables read in order (SFT's curated and cold-start rows)
            moved[name] = [beside(p, folder / f"{name}-{i}.parquet") for i, p in enumerate(path)]
        elif path:
            moved[name] = beside(path, folder / f"{name}.parquet")
    return job.model_copy(update=moved)


def launch_env(cfg: DistributedConfig) -> dict[str, str]:
    """The environment of an `accelerate launch` of the job (on any of its machines): each of this machine's
    processes a share of its cores and a wait policy that does not spin (grpo.cores; accelerate passes
    OMP_NUM_THREADS on to them)."""
    return {**cores.shared_env(cores.share(num_processes(cfg))),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
            "MASTER_ADDR": machine(cfg)[1], COLLECTIVE_TIMEOUT: str(cfg.collective_timeout_s),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # a timed-out NCCL collective raises instead of hanging


def _run(cmd: list[str], n: int, events: Path, result: Path, log: Path, cfg: DistributedConfig,
         on_metrics: MetricsCallback | None, on_samples: SamplesCallback | None) -> dict:
    with log.open("w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=launch_env(cfg), cwd=PROJECT_ROOT)
        try:
            _follow(lambda: proc.poll() is not None, events, on_metrics, on_samples)
        except BaseException:
            _stop_launch(proc)
            raise
    if proc.returncode != 0 or not result.exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"training on {n} processes failed (exit code {proc.returncode}); `{' '.join(cmd)}`; "
                           f"the end of {log}:\n{tail}")
    return json.loads(result.read_text())


def join_dir() -> Path:
    """R1_JOIN_DIR: the folder machine 0 announces its job in, one every machine of the job mounts."""
    folder = os.environ.get(JOIN_DIR)
    if not folder:
        raise ValueError(f"a launch across machines needs {JOIN_DIR}: a folder every machine of the job mounts, where "
                         f"machine 0 says which job file the others run")
    return Path(folder)


def announce(job_file: Path) -> None:
    """Tell the job's other machines which job file to run (written whole, then renamed into place)."""
    folder = join_dir()
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f".{ANNOUNCEMENT}.part"
    part.write_text(json.dumps({"job_file": str(job_file.resolve())}))
    part.replace(folder / ANNOUNCEMENT)


def _stop_launch(proc: subprocess.Popen, grace: float = 10) -> None:
    """End the launch and every process it started: SIGTERM to the launcher (which passes it to its workers), then
    SIGKILL to whatever is left after `grace` seconds, so a stopped stage is gone within a Ctrl-C's 30 s."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(family, timeout=1)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _follow(ended: Callable[[], bool], events: Path, on_metrics: MetricsCallback | None,
            on_samples: SamplesCallback | None) -> None:
    """Hand each complete line of the events file to its callback until the training has `ended()` and all is read.
    A report seen before (the same step and names: steps trained again after Ray Train restarted the workers from
    a checkpoint) is passed on once."""
    offset, seen = 0, set()
    while True:
        done = ended()
        if events.exists():
            with events.open("rb") as f:
                f.seek(offset)
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next round
            offset += len(complete)
            for line in complete.splitlines():
                event = json.loads(line)
                what = (event["step"], "samples" if "samples" in event else tuple(sorted(event.get("metrics", {}))))
                if what in seen:
                    continue
                seen.add(what)
                if "metrics" in event and on_metrics:
                    on_metrics(event["step"], event["metrics"])
                elif "samples" in event and on_samples:
                    split = event["samples"]
                    on_samples(event["step"], pd.DataFrame(split["data"], columns=split["columns"]))
        if done:
            return
        time.sleep(0.5)


