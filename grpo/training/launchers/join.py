"""What each machine but the first of a multi-machine training job runs: its share of the stage's processes.

    python -m grpo.training.launchers.join [--timeout-s S]

A stage whose `distributed.num_machines` is above 1 runs as a job of that many machines (pods), each mounting the
same R1_HOME and R1_JOIN_DIR. The stage's Prefect flow runs on machine 0: its task writes the job file, starts its
processes, and announces the job file in R1_JOIN_DIR (`grpo.training.launchers.launch`). Every other machine runs this module:
it waits for the announcement, then starts its own `num_processes` with `accelerate launch --machine_rank
$R1_MACHINE_RANK` on that job file, and exits with the launch's exit code once training ends. Only machine 0 reports
(its task follows rank 0's events and talks to MLflow); a failure on any machine fails the whole launch. Imports
neither Prefect nor MLflow.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from grpo.training.launchers import launch


def wait_for_job(folder: Path, timeout_s: float) -> Path:
    """The job file machine 0 announces in `folder`, once it does (within `timeout_s`)."""
    announcement = folder / launch.ANNOUNCEMENT
    deadline = time.monotonic() + timeout_s
    while not announcement.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no training job announced in {folder} within {timeout_s:g} s: machine 0 of this job "
                             f"has not started its launch (is its stage running, with the same {launch.JOIN_DIR}?)")
        time.sleep(0.5)
    job_file = Path(json.loads(announcement.read_text())["job_file"])
    if not job_file.is_file():
        raise SystemExit(f"{announcement} names {job_file}, which this machine cannot read: R1_HOME must be on "
                         f"storage every machine of the job mounts")
    return job_file


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m grpo.training.launchers.join", description=__doc__.splitlines()[0])
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="how long to wait for machine 0's job")
    args = ap.parse_args(argv)
    from grpo.training.jobs import read_launched

    job_file = wait_for_job(launch.join_dir(), args.timeout_s)
    cfg = read_launched(job_file.read_text()).job.distributed
    rank, _, _ = launch.machine(cfg)
    if rank == 0:
        raise SystemExit(f"{launch.MACHINE_RANK} is 0 here: machine 0 runs the stage itself; this command is for "
                         f"the job's other machines")
    cmd = launch.launch_command(cfg, launch.num_processes(cfg), job_file, 0)
    print(f"machine {rank} of {cfg.num_machines}: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, env=launch.launch_env(cfg), cwd=launch.PROJECT_ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
