"""Threads that fit the cores (grpo.cores): each process started beside others gets a share and passive waits."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from grpo import cores

VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")


def test_a_share_is_the_cores_split_evenly_and_at_least_one():
    assert cores.share(2, cores=2) == 1
    assert cores.share(3, cores=16) == 5
    assert cores.share(4, cores=1) == 1
    assert cores.share(0, cores=8) == 8  # no other process: all of them
    assert cores.share(1) == cores.cpu_cores() >= 1


def test_what_the_user_set_wins_over_the_share():
    assert cores.thread_env(3, {}) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    user = {"OMP_NUM_THREADS": "6", "OMP_WAIT_POLICY": "ACTIVE", "PATH": "/bin"}
    assert cores.thread_env(3, user) == {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "6", "OMP_WAIT_POLICY": "ACTIVE"}
    assert cores.shared_env(3, user) == {**user, "MKL_NUM_THREADS": "6"}  # MKL follows the user's OMP setting
    assert cores.thread_env(3, {"MKL_NUM_THREADS": "4"})["MKL_NUM_THREADS"] == "4"
    assert cores.thread_env(3, {"OMP_NUM_THREADS": ""})["OMP_NUM_THREADS"] == "3"  # set empty is unset


def _report(queue) -> None:
    import torch

    queue.put(({var: os.environ.get(var) for var in VARS}, torch.get_num_threads()))


def test_a_spawned_process_gets_its_share_and_this_process_keeps_its_environment(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with cores.children_share(1):
        child = ctx.Process(target=_report, args=(queue,))
        child.start()
    env, threads = queue.get(timeout=120)
    child.join(60)
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert threads == 1  # torch read it when it started
    assert all(var not in os.environ for var in VARS)  # restored: this process's later children are its own


def test_the_user_set_threads_reach_a_spawned_process(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with cores.children_share(1):
        child = ctx.Process(target=_report, args=(queue,))
        child.start()
    env, threads = queue.get(timeout=120)
    child.join(60)
    assert env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"} and threads == 2
    assert os.environ["OMP_NUM_THREADS"] == "2" and "MKL_NUM_THREADS" not in os.environ


@pytest.mark.parametrize("processes", [1, 2])
def test_a_launch_gives_each_process_of_this_machine_its_share(processes, monkeypatch):
    from grpo.configs.distributed import DistributedConfig
    from grpo.training.launchers.launch import launch_env

    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    env = launch_env(DistributedConfig(num_processes=processes))
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(cores.share(processes))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_sweep_points_on_this_machine_share_its_cores(tmp_path, monkeypatch):
    from flows.sweep_launch import Processes

    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    points = Processes("tiny", "run-id", tmp_path, parallel=2)
    assert points.threads == cores.share(2)
    seen = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'], "
                           "os.environ['OMP_WAIT_POLICY'])"], env=points.env(), capture_output=True, text=True,
                          check=True)
    assert seen.stdout.split() == [str(cores.share(2)), "PASSIVE"]
