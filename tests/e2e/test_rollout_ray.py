"""Asynchronous GRPO with its samplers as Ray actors (`rollout.launcher: ray`) on a real Ray cluster on 127.0.0.1:
the synchronous weights at max_staleness 0, an actor killed or stopped named and replaced, no actor left behind.

A one-node cluster of its own (`ray start --block`, 3 logical CPUs: a Ray Train worker, its trainer and a sampler
actor), a real tiny model; fp32 and one thread a process where numbers are compared."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the driver keeps 127.0.0.1 too (before ray is imported)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)

from grpo.configs.sampling import SamplingConfig  # noqa: E402
from grpo.configs.training import GRPOConfig  # noqa: E402
from grpo.configs.rollout import RolloutConfig  # noqa: E402
from grpo.models import load_model_and_tokenizer  # noqa: E402
from grpo.training.loops.grpo_trainer import GRPOTrainer  # noqa: E402
from grpo.training.rollouts import FAULT_POINTS, FAULTS, FAULTS_DIR, RolloutError  # noqa: E402
from processes import alive  # noqa: E402
from ray_local import LocalRayCluster  # noqa: E402
from rollout_runs import PROMPTS, digits, run, weights  # noqa: E402
from tiny_configs import SMALL  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread, as each actor has (conftest)


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="r1ray-", dir="/tmp"))  # short: Ray's unix socket paths live under it
    (root / "shared").mkdir()
    cluster = LocalRayCluster(root / "c", cpus_per_node=3).start(n_nodes=1)
    try:
        cluster.wait_ready()
        yield {"address": cluster.address, "shared": root / "shared"}
    finally:
        import ray

        ray.shutdown()
        stragglers = cluster.stop()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    assert not stragglers, f"processes left after stopping the node: {stragglers}"


@pytest.fixture(scope="module")
def address(cluster):
    return cluster["address"]


def on_ray(address: str, **kw) -> RolloutConfig:
    return RolloutConfig(mode="async", launcher="ray", ray_address=address, threads=1, **kw)


def gone_within(pids: list[int], seconds: float = 10.0) -> bool:
    deadline = time.time() + seconds
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    return not any(alive(p) for p in pids)


def test_max_staleness_0_on_ray_actors_trains_the_synchronous_weights(tmp_path, address):
    """The actor draws the synchronous loop's tokens from the same weights: after three steps every weight is equal,
    bit for bit, and the behaviour weight is 1 on every token."""
    seen_sync, seen_ray = {}, {}
    sync = run(tmp_path / "sync", seen=seen_sync, tis_cap=2.0)
    on = run(tmp_path / "ray", seen=seen_ray, rollout=on_ray(address, max_staleness=0))
    a, b = weights(sync), weights(on)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    assert [seen_sync[s]["reward/total"] for s in (1, 2, 3)] == [seen_ray[s]["reward/total"] for s in (1, 2, 3)]
    assert all(seen_ray[s]["async/staleness_max"] == 0 for s in (1, 2, 3))
    assert all(seen_ray[s]["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5) for s in (1, 2, 3))


@pytest.mark.parametrize("signum, timeout_s", [(signal.SIGKILL, 60.0), (signal.SIGSTOP, 4.0)])
def test_a_killed_or_stopped_actor_is_named_and_replaced_and_none_is_left(tmp_path, caplog, address, signum,
                                                                         timeout_s):
    seen, held, pids, sent = {}, {}, set(), []

    def reward(completions, **_):
        actors = [a for a in held["trainer"].source.rollouts.workers if a is not None]
        pids.update(a.pid for a in actors if a.pid)
        if len(sent) == 0 and seen.get(1) is not None and actors[0].pid:  # after step 1: its actor
            os.kill(actors[0].pid, signum)
            sent.append(time.time())
        return digits(completions)

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(max_steps=5, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                     sampling=SamplingConfig(max_new_tokens=8), rewards={"digits": 1.0}, mixed_precision="no",
                     rollout=on_ray(address, max_staleness=1, timeout_s=timeout_s))
    trainer = held["trainer"] = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, progress=False,
                                            reward_functions={"digits": reward},
                                            on_metrics=lambda step, m: seen.__setitem__(step, m))
    with caplog.at_level("WARNING", logger="grpo.training.rollouts"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if "rollout worker" in r.getMessage()]
    assert sent and len(lines) == 1 and "Ray actor, pid" in lines[0] and "replaced by a new one" in lines[0], lines
    assert ("died" if signum == signal.SIGKILL else "gave no sign of life") in lines[0], lines[0]
    assert sorted(seen) == [1, 2, 3, 4, 5] and seen[5]["async/restarts"] == 1
    assert all(seen[s]["async/staleness_max"] <= 1 for s in seen)
    assert len(pids) == 2 and gone_within(sorted(pids))  # the replaced actor and its replacement: both ended


def test_an_actor_stopped_at_each_point_of_the_protocol_is_replaced_and_trains_the_same(tmp_path, monkeypatch, caplog,
                                                                                      address):
    """The actor stops (SIGSTOP) at start-up, before its first weights, before a unit, after one, before a later
    push's weights and after its last unit, each once: named and replaced within the timeout, and the run trains the
    synchronous loop's weights. (An actor hands over whole units only, its poll's answer: there is no halfway.)"""
    points = [point for point in FAULT_POINTS if point != "mid-send"]
    fired = tmp_path / "fired"
    fired.mkdir()
    monkeypatch.setenv(FAULTS, ",".join(f"{point}:stop" for point in points))
    monkeypatch.setenv(FAULTS_DIR, str(fired))
    sync = run(tmp_path / "sync", tis_cap=2.0)
    with caplog.at_level("WARNING", logger="grpo.training.rollouts"):
        faulty = run(tmp_path / "ray", rollout=on_ray(address, max_staleness=0, timeout_s=3.0,
                                                      max_restarts=len(points)))
    assert sorted(os.listdir(fired)) == sorted(f"{point}-stop" for point in points)
    lines = [r.getMessage() for r in caplog.records if "rollout worker" in r.getMessage()]
    assert len(points) - 1 <= len(lines) <= len(points) and all("gave no sign of life" in x for x in lines), lines
    records = [r for r in caplog.records if "rollout worker" in r.getMessage()]
    when = sorted((fired / name).stat().st_mtime for name in os.listdir(fired))
    for fault_at, record in zip(when, records):  # each within the timeout (a poll every 0.2 s) and a margin
        assert 0 <= record.created - fault_at < 3.0 + 5, (record.created - fault_at, record.getMessage())
    a, b = weights(sync), weights(faulty)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]


def test_a_cluster_without_room_for_the_actors_fails_in_one_line_before_sampling(tmp_path, address):
    with pytest.raises(RolloutError, match=r"^rollout.workers 3 Ray actors ask for 6 CPUs \(rollout.threads 2 "
                                           r"each\); the cluster has 3 CPUs"):
        run(tmp_path, rollout=RolloutConfig(mode="async", launcher="ray", ray_address=address, workers=3, threads=2))


def test_the_stage_checks_the_actors_cluster_before_any_model_loads():
    from grpo.configs.distributed import DistributedConfig
    from runtime.cluster import check_rollout_cluster

    here = DistributedConfig()
    cfg = GRPOConfig(rollout=RolloutConfig(mode="async", launcher="ray", ray_address="127.0.0.1:1"))
    with pytest.raises(ConnectionError, match=r"^no Ray cluster at '127.0.0.1:1'"):
        check_rollout_cluster(cfg, here, "reasoning_grpo")
    unnamed = GRPOConfig(rollout=RolloutConfig(mode="async", launcher="ray"))
    with pytest.raises(ValueError, match=r"reasoning_grpo.grpo.rollout.launcher is ray but names no cluster"):
        check_rollout_cluster(unnamed, here, "reasoning_grpo")
    on_train = DistributedConfig(engine="ray", ray_address="127.0.0.1:2", shared_dir="/srv/r1")
    with pytest.raises(ConnectionError, match=r"^no Ray cluster at '127.0.0.1:2'"):  # its Ray Train workers' cluster
        check_rollout_cluster(unnamed, on_train, "reasoning_grpo")
    assert check_rollout_cluster(GRPOConfig(), here, "reasoning_grpo") == GRPOConfig()


def test_the_actors_take_the_recipe_s_ray_cluster_unless_they_name_their_own():
    from grpo.configs.recipe import apply_overrides, load_recipe

    on = {"rejection_sampling.cluster.ray_address": "head:6379",
          "rejection_sampling.cluster.shard_store": "s3://bucket/r1",
          "reasoning_grpo.grpo.rollout.mode": "async", "reasoning_grpo.grpo.rollout.launcher": "ray"}
    cfg = apply_overrides(load_recipe("tiny"), on)
    assert cfg.reasoning_grpo.grpo.rollout.ray_address == "head:6379"
    assert cfg.alignment_grpo.grpo.rollout.ray_address is None  # its samplers are processes here
    own = apply_overrides(load_recipe("tiny"), {**on, "reasoning_grpo.grpo.rollout.ray_address": "other:6379"})
    assert own.reasoning_grpo.grpo.rollout.ray_address == "other:6379"
    # a stage whose Ray Train workers name a cluster samples on that one, not on the recipe's (one rule, read alike
    # by the recipe and by the stage's check: grpo.configs.distributed.rollout_ray_address)
    trains = apply_overrides(load_recipe("tiny"), {**on, "reasoning_grpo.distributed.engine": "ray",
                                                  "reasoning_grpo.distributed.ray_address": "train:6379",
                                                  "reasoning_grpo.distributed.shared_dir": "/srv/r1"})
    assert trains.reasoning_grpo.grpo.rollout.ray_address == "train:6379"
    assert trains.reasoning_grpo.distributed.ray_address == "train:6379"


def test_a_stage_on_ray_train_workers_samples_on_ray_actors(prefect_harness, mlflow_client, cluster):
    """`distributed.engine: ray` with `rollout.launcher: ray`: the training process is a Ray Train worker, and the
    sampler actor it starts runs outside its placement group; the stage finishes, its figures in its MLflow run."""
    from flows.cold_start_sft import cold_start_sft
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ColdStartSFTConfig, ReasoningGRPOConfig
    from tiny_configs import TINY_GRPO, TINY_STAGE

    cold = cold_start_sft(ColdStartSFTConfig.model_validate({**TINY_STAGE, "data": {"num_train": 16,
                                                                                    "num_heldout": 0}}))
    cfg = ReasoningGRPOConfig.model_validate({
        **TINY_GRPO, "data": {"num_train": 16, "num_heldout": 0}, "eval_before": False,
        "grpo": {**TINY_GRPO["grpo"], "max_steps": 3, "samples_every": 0,
                 "rollout": {"mode": "async", "launcher": "ray", "max_staleness": 1, "threads": 1}},
        "distributed": {"engine": "ray", "ray_address": cluster["address"], "num_workers": 1,
                        "shared_dir": str(cluster["shared"])}})
    result = reasoning_grpo(cold.uris["checkpoint"], cfg)
    assert mlflow_client.get_run(result.run_id).info.status == "FINISHED"
    staleness = mlflow_client.get_metric_history(result.run_id, "async/staleness_max")
    assert sorted(m.step for m in staleness) == [1, 2, 3] and all(0 <= m.value <= 1 for m in staleness)
