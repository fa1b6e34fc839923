"""A training stage on a real Ray cluster (`distributed.engine: ray`): a head and a second node on this machine, one
Ray Train worker on each, training reasoning GRPO with FSDP; the second node killed with SIGKILL (all its
processes) after a checkpoint, a new node joining, and the stage finishing from that checkpoint.

The nodes have their own HOME, TMPDIR and R1_HOME, and (where the kernel allows a mount namespace) the driver's
folders are covered by an empty tmpfs on them: a worker reads only the shared folder (`distributed.shared_dir`),
where the stage's job, inputs and checkpoints live. fp32 is pinned: the resumed stage must end with the weights of
the same stage run without the kill.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the driver keeps 127.0.0.1 too (before ray is imported)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)

from ray_local import LocalRayCluster  # noqa: E402
from runs import weights  # noqa: E402
from tiny_configs import TINY_GRPO, TINY_STAGE  # noqa: E402


@pytest.fixture(scope="module")
def cluster(r1_home, tmp_path_factory):
    root = Path(tempfile.mkdtemp(prefix="r1rt-", dir="/tmp"))  # short: Ray's unix socket paths live under it
    (root / "shared").mkdir()
    ray = LocalRayCluster(root / "c", hide=[r1_home, tmp_path_factory.getbasetemp()]).start(n_nodes=2)
    try:
        ray.wait_ready()
        yield {"ray": ray, "root": root, "shared": root / "shared"}
    finally:
        import ray as ray_module

        ray_module.shutdown()
        stragglers = ray.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    assert not stragglers, f"processes left after stopping the nodes' groups: {stragglers}"


def grpo_section(cluster, **distributed) -> dict:
    return {**TINY_GRPO, "data": {"num_train": 32, "num_heldout": 0},
            "grpo": {**TINY_GRPO["grpo"], "max_steps": 16, "checkpoint_every": 2, "seed": 31, "samples_every": 0},
            "eval_before": False,
            "distributed": {"engine": "ray", "ray_address": cluster["ray"].address, "num_workers": 2,
                            "shared_dir": str(cluster["shared"]), "strategy": "fsdp", **distributed}}


def test_a_grpo_stage_on_ray_survives_losing_a_node(prefect_harness, mlflow_client, cluster, tmp_path,
                                                    monkeypatch):
    from flows.cold_start_sft import cold_start_sft
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ColdStartSFTConfig, ReasoningGRPOConfig
    from grpo.training.launchers.ray_train import worker_starts
    from runtime import durable
    from runtime import tracking
    from runtime.durable import newest_copy

    monkeypatch.setattr(durable, "EVERY_S", 0.05)  # checkpoints copied as soon as they are written
    since = int(time.time() * 1000)  # the runs this test makes (earlier tests may leave theirs as they left them)

    cold = cold_start_sft(ColdStartSFTConfig.model_validate(
        {**TINY_STAGE, "data": {"num_train": 32, "num_heldout": 0},
         "train": {**TINY_STAGE["train"], "max_steps": 20, "learning_rate": 1e-2, "seed": 31}}))
    checkpoint = cold.uris["checkpoint"]
    cfg = ReasoningGRPOConfig.model_validate(grpo_section(cluster))
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = reasoning_grpo(checkpoint, cfg)
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    stage = threading.Thread(target=run, daemon=True)
    stage.start()

    def work_dir():
        for r in tracking.find_runs("tags.stage = 'reasoning_grpo' and attributes.status = 'RUNNING'"):
            if "r1.work_dir.reasoning_grpo" in r.data.tags:
                return Path(r.data.tags["r1.work_dir.reasoning_grpo"])
        return None

    deadline = time.monotonic() + 300
    while (work := work_dir()) is None or not newest_copy(work.name):
        assert stage.is_alive(), outcome
        assert time.monotonic() < deadline, "no durable checkpoint within 300 s"
        time.sleep(0.2)
    assert work.is_relative_to(cluster["shared"])  # the work folder is in the folder every node mounts
    lost = cluster["ray"].nodes[1]
    os.killpg(lost.proc.pid, signal.SIGKILL)  # the node and every process on it (its training worker too)
    lost.proc.wait(10)
    cluster["ray"]._start_node("n2")  # a replacement joins; Ray Train starts the workers again
    cluster["ray"]._wait(cluster["ray"].nodes[-1], time.monotonic() + 240)
    stage.join(600)
    assert not stage.is_alive() and "error" not in outcome, outcome.get("error")
    result = outcome["result"]

    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    starts = worker_starts(work / "launch" / "job.json")
    assert sorted(s["rank"] for s in starts) == [0, 0, 1, 1], starts  # both workers started again, once
    assert len({s["pid"] for s in starts if s["rank"] == 1}) == 2
    history = mlflow_client.get_metric_history(result.run_id, "reward/total")
    assert sorted(m.step for m in history) == list(range(1, 17))  # each step logged once, restart or not
    assert not tracking.find_runs(f"attributes.status = 'RUNNING' and attributes.start_time >= {since}")

    whole = reasoning_grpo(checkpoint, cfg)  # the same stage, never interrupted
    a = weights(result.uris["checkpoint"], tmp_path / "a")
    b = weights(whole.uris["checkpoint"], tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)


def test_a_ray_stage_asking_for_more_workers_than_the_cluster_has_is_refused_before_training(cluster):
    from grpo.configs.distributed import DistributedConfig
    from runtime.cluster import check_training_cluster

    cfg = DistributedConfig.model_validate(grpo_section(cluster, num_workers=8)["distributed"])
    with pytest.raises(ValueError, match=r"distributed.num_workers=8: the Ray cluster at 127.0.0.1:\d+ has 2 CPUs "
                                         r"and no GPU"):
        check_training_cluster(cfg, "reasoning_grpo")
    nobody = DistributedConfig.model_validate({**cfg.model_dump(), "num_workers": 2, "ray_address": "127.0.0.1:9"})
    with pytest.raises(ConnectionError, match=r"no Ray cluster at '127.0.0.1:9'"):
        check_training_cluster(nobody, "reasoning_grpo")
