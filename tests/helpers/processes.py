"""Processes the tests start and watch: two-process launches of the helper scripts here, `r1` commands in process
groups of their own, waiting on them and killing them.

`ROOT` is the project folder (the `PYTHONPATH` and working folder an `r1` process gets), `HELPERS` this folder: the
scripts launched by path (ddp_loops.py, ddp_async.py, ddp_packed.py, dpo_loops.py) live here and import each other.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil

from grpo.ports import free_port

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]
STOP_WITHIN_S = 30  # how long `r1` may take to exit after Ctrl-C or SIGTERM


def launch_two_processes(script: Path, out: Path, **env: str) -> None:
    """`script out` on two CPU processes under `accelerate launch` (gloo on 127.0.0.1); its output on a failure."""
    from grpo.training.launchers import launch

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()), str(script), str(out)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "", **env,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]


def r1_run(recipe: Path, *args: str) -> subprocess.Popen:
    """`r1 run` in a process of its own (and process group, as a terminal starts it) on the same home and the same
    Prefect API as the tests (a server, so the process starts no temporary one of its own)."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT),
           "R1_DURABLE_EVERY_S": "0.05"}  # checkpoints copied as soon as they are written: a kill can follow one
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--recipe", str(recipe), *args], cwd=ROOT,
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for(what, check, proc: subprocess.Popen, timeout: float = 240, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"r1 run ended ({proc.returncode}) before {what}:\n{proc.stdout.read().decode()[-3000:]}")
        time.sleep(every)
    proc.kill()
    raise AssertionError(f"no {what} within {timeout} s")


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def frozen_code(into: Path) -> Path:
    """A copy of the project's code (its packages and recipes) as it is now, for `r1` commands that must run the same
    code: a stage's reuse key digests the code (tasks.reuse.code_version), so an edit to the checkout between two
    commands, made by anyone working in it meanwhile, rightly makes the second train again instead of reusing."""
    import shutil

    for name in ("grpo", "tasks", "flows", "recipes", "deployments"):
        shutil.copytree(ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__", ".*"))
    return into


class R1:
    """One `r1` command on its own embedded home: its process, output and MLflow store."""

    def __init__(self, home: Path, args: list[str], log_dir: Path | None = None, code: Path = ROOT):
        """`code`: the project whose code it runs (the checkout, or a `frozen_code` copy of it)."""
        from mlflow import MlflowClient

        self.home = home
        env = {k: v for k, v in os.environ.items()
               if k not in ("MLFLOW_TRACKING_URI", "PREFECT_HOME", "PREFECT_API_URL")}
        env.update(R1_HOME=str(home), PYTHONPATH=str(code))
        log_dir = log_dir or home.parent  # elsewhere where the home's disk is to fill up
        self.log = (log_dir / f"{home.name}-{int(time.time() * 1000)}.log").open("w+b")
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=code, env=env,
                                     start_new_session=True, stdout=self.log, stderr=subprocess.STDOUT)
        self.mlflow = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def runs(self) -> list:
        if not (self.home / "mlflow.db").exists():
            return []
        try:
            return self.mlflow.search_runs([e.experiment_id for e in self.mlflow.search_experiments()])
        except Exception:  # the store is being created by the run
            return []

    def wait_for(self, what: str, check, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"r1 ended ({self.proc.returncode}) before {what}:\n{self.output()[-3000:]}")
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"no {what} within {timeout} s:\n{self.output()[-3000:]}")

    def stop(self, sig: int, whole_group: bool) -> tuple[float, list[psutil.Process]]:
        """Send `sig`; return how long r1 took to exit, and the processes it had started (alive or not)."""
        family = psutil.Process(self.proc.pid).children(recursive=True)
        sent = time.monotonic()
        (os.killpg if whole_group else os.kill)(self.proc.pid, sig)
        try:
            self.proc.wait(STOP_WITHIN_S + 30)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"r1 did not exit within {STOP_WITHIN_S + 30} s of the signal:\n"
                                 f"{self.output()[-3000:]}")
        return time.monotonic() - sent, family

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def flow_run_states(self) -> list[str]:
        with sqlite3.connect(self.home / "prefect" / "prefect.db") as db:
            return [row[0] for row in db.execute("SELECT state_type FROM flow_run")]
