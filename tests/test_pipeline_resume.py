"""Running the same pipeline again reuses what finished and resumes what was interrupted; `fresh` starts over.

Real MLflow (the session's SQLite), the real Prefect harness, the tiny model with a cut-down recipe. The crash is
real: an `r1 run` in its own process killed with SIGKILL once reasoning GRPO has written a checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from test_flows import TINY_GRPO, TINY_RS, TINY_STAGE

ROOT = Path(__file__).resolve().parents[1]
# no held-out split (no evaluation) and seeds of their own, so no other test's stage is reused here
COLD = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0}, "train": {**TINY_STAGE["train"], "seed": 11}}
GRPO = {**TINY_GRPO, "data": {"num_train": 32, "num_heldout": 0}, "grpo": {**TINY_GRPO["grpo"], "seed": 11}}
RS = {**TINY_RS, "rejection": {**TINY_RS["rejection"], "seed": 11}}
THREE = ["cold_start_sft", "reasoning_grpo", "rejection_sampling"]


def write_recipe(path: Path, name: str, **sections) -> Path:
    path.write_text(yaml.safe_dump({"name": name, "cold_start_sft": COLD, "reasoning_grpo": GRPO,
                                    "rejection_sampling": RS, **sections}))
    return path


def children(client, parent_run_id: str) -> dict:
    """A pipeline run's stage runs by stage (the newest where a stage has two)."""
    runs = client.search_runs([client.get_run(parent_run_id).info.experiment_id],
                              f"tags.`mlflow.parentRunId` = '{parent_run_id}'", order_by=["attributes.start_time ASC"])
    return {r.data.tags["stage"]: r for r in runs}


def weights(client, checkpoint_uri: str, dst: Path) -> dict[str, torch.Tensor]:
    from tasks.tracking import download

    return load_file(download(checkpoint_uri, dst) / "model.safetensors")


@pytest.fixture(scope="module")
def first(prefect_harness, tmp_path_factory):
    from flows.r1_pipeline import r1_pipeline

    recipe = write_recipe(tmp_path_factory.mktemp("resume") / "resume.yaml", "resume")
    return r1_pipeline(recipe=str(recipe), stages=THREE), recipe


def test_the_same_run_again_reuses_every_stage(first, mlflow_client):
    from flows.r1_pipeline import r1_pipeline

    result, recipe = first
    again = r1_pipeline(recipe=str(recipe), stages=THREE)
    assert again.run_id != result.run_id
    assert mlflow_client.get_run(again.run_id).info.status == "FINISHED"
    runs = children(mlflow_client, again.run_id)
    for stage in THREE:
        run = runs[stage]
        assert run.info.status == "FINISHED" and run.info.run_id == again.stages[stage].run_id
        assert run.data.tags["r1.reused_from"] == result.stages[stage].run_id, stage
        assert again.stages[stage].uris == result.stages[stage].uris, stage  # the same checkpoints and datasets
        assert not mlflow_client.list_artifacts(run.info.run_id), stage  # nothing trained or sampled again
        assert "train/loss" not in run.data.metrics and "reward/total" not in run.data.metrics
    assert (mlflow_client.get_run(again.run_id).data.tags["uri.reasoning_checkpoint"]
            == result.stages["reasoning_grpo"].uris["checkpoint"])


def test_a_changed_stage_reruns_with_everything_after_it(first, mlflow_client, tmp_path):
    from flows.r1_pipeline import r1_pipeline

    result, _ = first
    recipe = write_recipe(tmp_path / "changed.yaml", "resume-changed",
                          reasoning_grpo={**GRPO, "grpo": {**GRPO["grpo"], "learning_rate": 2e-5}})
    changed = r1_pipeline(recipe=str(recipe), stages=THREE)
    runs = children(mlflow_client, changed.run_id)
    assert runs["cold_start_sft"].data.tags["r1.reused_from"] == result.stages["cold_start_sft"].run_id
    for stage in ("reasoning_grpo", "rejection_sampling"):
        assert "r1.reused_from" not in runs[stage].data.tags, stage
        assert changed.stages[stage].uris != result.stages[stage].uris, stage
    grpo = runs["reasoning_grpo"]
    assert grpo.data.params["grpo.learning_rate"] == "2e-05"
    assert grpo.data.params["input.checkpoint_uri"] == result.stages["cold_start_sft"].uris["checkpoint"]
    assert (runs["rejection_sampling"].data.params["input.checkpoint_uri"]
            == changed.stages["reasoning_grpo"].uris["checkpoint"])  # rerun because its input changed


def test_fresh_runs_every_stage_again(first, mlflow_client):
    from flows.r1_pipeline import r1_pipeline

    result, recipe = first
    fresh = r1_pipeline(recipe=str(recipe), stages=THREE[:2], fresh=True)
    assert mlflow_client.get_run(fresh.run_id).data.tags["r1.fresh"] == "true"
    runs = children(mlflow_client, fresh.run_id)
    for stage in THREE[:2]:
        assert "r1.reused_from" not in runs[stage].data.tags, stage
        assert fresh.stages[stage].uris["checkpoint"] != result.stages[stage].uris["checkpoint"], stage
        assert [m.step for m in mlflow_client.get_metric_history(runs[stage].info.run_id, "train/loss" if stage ==
                                                                 "cold_start_sft" else "reward/total")][0] in (1, 2)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_runs_a_dead_process_left_running_are_marked_failed_at_the_next_start(first, mlflow_client):
    from flows.r1_pipeline import r1_pipeline
    from tasks import tracking

    _, recipe = first
    mine = tracking.owner_tags()
    dead = tracking.start_run("dead", tags={"stage": "cold_start_sft"})
    tracking.set_tags(dead, {"r1.pid": str(_dead_pid())})
    reused_pid = tracking.start_run("reused-pid", tags={})  # our pid, but another process's start time
    tracking.set_tags(reused_pid, {"r1.process_started": f"{float(mine['r1.process_started']) - 3600:.2f}"})
    elsewhere = tracking.start_run("elsewhere", tags={})  # a dead pid on another host: not ours to judge
    tracking.set_tags(elsewhere, {"r1.host": "another-host", "r1.pid": str(_dead_pid())})
    alive = tracking.start_run("alive", tags={})  # this very process
    try:
        r1_pipeline(recipe=str(recipe), stages=THREE[:1])  # reused: a start and no training
        status = {name: mlflow_client.get_run(run).info.status for name, run in
                  [("dead", dead), ("reused_pid", reused_pid), ("elsewhere", elsewhere), ("alive", alive)]}
        assert status == {"dead": "FAILED", "reused_pid": "FAILED", "elsewhere": "RUNNING", "alive": "RUNNING"}
        assert "ended without closing" in mlflow_client.get_run(dead).data.tags["r1.ended_because"]
    finally:
        for run in (elsewhere, alive):
            tracking.end_run(run, "FINISHED")


def _r1_run(recipe: Path, prefect_home: Path, *args: str) -> subprocess.Popen:
    """`r1 run` in a process of its own (and its own process group, as a terminal starts it), on the same home."""
    env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--recipe", str(recipe), *args], cwd=ROOT,
                            env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(what, check, proc: subprocess.Popen, timeout: float = 240, every: float = 0.2):
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


def test_a_killed_run_resumes_from_its_last_checkpoint_and_ends_as_an_uninterrupted_one(
        prefect_harness, mlflow_client, tmp_path):
    from flows.r1_pipeline import r1_pipeline
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.config import ReasoningGRPOConfig
    from grpo.training.checkpoints import resumable_step
    from tasks import tracking

    grpo = {**GRPO, "grpo": {**GRPO["grpo"], "max_steps": 6, "checkpoint_every": 2, "seed": 12}}
    cold = {**COLD, "train": {**COLD["train"], "seed": 12}}
    recipe = write_recipe(tmp_path / "killed.yaml", "resume-killed", cold_start_sft=cold, reasoning_grpo=grpo)
    proc = _r1_run(recipe, tmp_path / "prefect", "--stages", "cold_start_sft,reasoning_grpo")

    def grpo_work_dir():
        runs = tracking.find_runs("tags.stage = 'reasoning_grpo' and attributes.status = 'RUNNING'")
        parents = {r.info.run_id for r in tracking.find_runs("tags.recipe = 'resume-killed'")}
        return next((Path(r.data.tags["r1.work_dir.reasoning_grpo"]) for r in runs
                     if r.data.tags.get("mlflow.parentRunId") in parents and "r1.work_dir.reasoning_grpo" in
                     r.data.tags), None)

    try:
        work = _wait_for("a reasoning_grpo run", grpo_work_dir, proc)
        _wait_for("a GRPO checkpoint", lambda: resumable_step(work), proc, every=0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9, the Prefect server it started included
        proc.wait()
    step = resumable_step(work)
    assert 2 <= step < 6
    [killed] = tracking.find_runs("tags.recipe = 'resume-killed'")
    killed_runs = children(mlflow_client, killed.info.run_id)
    assert killed.info.status == "RUNNING" and killed_runs["reasoning_grpo"].info.status == "RUNNING"

    result = r1_pipeline(recipe=str(recipe), stages=["cold_start_sft", "reasoning_grpo"])

    for run in (killed, killed_runs["reasoning_grpo"]):  # the dead process's runs, closed by the next start
        assert mlflow_client.get_run(run.info.run_id).info.status == "FAILED"
    runs = children(mlflow_client, result.run_id)
    assert runs["cold_start_sft"].data.tags["r1.reused_from"] == killed_runs["cold_start_sft"].info.run_id
    resumed = runs["reasoning_grpo"]
    assert resumed.data.tags["r1.resumed_from_step"] == str(step)
    assert resumed.data.tags["r1.work_dir.reasoning_grpo"] == str(work)
    history = mlflow_client.get_metric_history(resumed.info.run_id, "reward/total")
    assert sorted(m.step for m in history) == list(range(step + 1, 7))  # only the steps after the checkpoint

    # the same stage uninterrupted, from the same cold start: the same weights
    checkpoint = result.stages["cold_start_sft"].uris["checkpoint"]
    whole = reasoning_grpo(checkpoint, ReasoningGRPOConfig.model_validate(grpo))
    assert "r1.resumed_from_step" not in mlflow_client.get_run(whole.run_id).data.tags
    a = weights(mlflow_client, result.stages["reasoning_grpo"].uris["checkpoint"], tmp_path / "a")
    b = weights(mlflow_client, whole.uris["checkpoint"], tmp_path / "b")
    start = weights(mlflow_client, checkpoint, tmp_path / "c")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], start[k]) for k in a)  # GRPO did move the weights
