"""Running the same pipeline again reuses what finished and resumes what was interrupted; `fresh` starts over.

Real MLflow (the session's SQLite), the real Prefect harness, the tiny model with a cut-down recipe. The crash is
real: an `r1 run` in its own process killed with SIGKILL once reasoning GRPO has written a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from processes import ROOT, kill_group, r1_run, wait_for
from runs import children, weights
from tiny_configs import TINY_GRPO, TINY_RS, TINY_STAGE

# no held-out split (no evaluation) and seeds of their own, so no other test's stage is reused here
COLD = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0}, "train": {**TINY_STAGE["train"], "seed": 11}}
GRPO = {**TINY_GRPO, "data": {"num_train": 32, "num_heldout": 0}, "grpo": {**TINY_GRPO["grpo"], "seed": 11}}
RS = {**TINY_RS, "rejection": {**TINY_RS["rejection"], "seed": 11}}
THREE = ["cold_start_sft", "reasoning_grpo", "rejection_sampling"]


def write_recipe(path: Path, name: str, **sections) -> Path:
    path.write_text(yaml.safe_dump({"name": name, "cold_start_sft": COLD, "reasoning_grpo": GRPO,
                                    "rejection_sampling": RS, **sections}))
    return path


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
    assert grpo.data.params["grpo.optimizer.learning_rate"] == "2e-05"
    assert grpo.data.params["input.checkpoint_uri"] == result.stages["cold_start_sft"].uris["checkpoint"]
    assert (runs["rejection_sampling"].data.params["input.checkpoint_uri"]
            == changed.stages["reasoning_grpo"].uris["checkpoint"])  # rerun because its input changed


def test_fresh_runs_the_stages_again(first, mlflow_client):
    from flows.r1_pipeline import r1_pipeline

    result, recipe = first
    fresh = r1_pipeline(recipe=str(recipe), stages=THREE[:1], fresh=True)
    assert mlflow_client.get_run(fresh.run_id).data.tags["r1.fresh"] == "true"
    run = children(mlflow_client, fresh.run_id)["cold_start_sft"]
    assert "r1.reused_from" not in run.data.tags and run.data.tags["r1.fresh"] == "true"
    assert fresh.stages["cold_start_sft"].uris["checkpoint"] != result.stages["cold_start_sft"].uris["checkpoint"]
    assert [m.step for m in mlflow_client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4]  # all of it


def test_a_work_folder_is_used_by_one_run_at_a_time(mlflow_client):
    from runtime import tracking
    from runtime.stage import FRESH, release_work_dirs, work_dir

    first_run, second_run = tracking.start_run("a", tags={}), tracking.start_run("b", tags={})
    shared = work_dir(first_run, "locked", "same inputs")
    (shared / "checkpoints").mkdir()
    private = work_dir(second_run, "locked", "same inputs")  # the same inputs while the first holds the folder
    assert private != shared and private.name.startswith(shared.name) and not any(private.glob("[!.]*"))
    assert work_dir(first_run, "locked", "same inputs") == shared  # asked again: the one it holds
    assert mlflow_client.get_run(second_run).data.tags["r1.work_dir.locked"] == str(private)
    release_work_dirs(second_run)
    assert not private.exists()  # a private folder cannot be resumed by anyone: gone with its run
    release_work_dirs(first_run)
    third_run = tracking.start_run("c", tags={})
    assert work_dir(third_run, "locked", "same inputs") == shared and (shared / "checkpoints").exists()  # resumable
    release_work_dirs(third_run)
    fresh_run = tracking.start_run("d", tags={FRESH: "true"})
    assert work_dir(fresh_run, "locked", "same inputs") == shared and not (shared / "checkpoints").exists()
    release_work_dirs(fresh_run)
    for run in (first_run, second_run, third_run, fresh_run):
        tracking.end_run(run)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_runs_a_dead_process_left_running_are_marked_failed_at_the_next_start(first, mlflow_client):
    from flows.r1_pipeline import r1_pipeline
    from runtime import heartbeat, tracking

    _, recipe = first
    mine = tracking.owner_tags()
    dead = tracking.start_run("dead", tags={"stage": "cold_start_sft"})
    tracking.set_tags(dead, {"r1.pid": str(_dead_pid())})
    reused_pid = tracking.start_run("reused-pid", tags={})  # our pid, but another process's start time
    tracking.set_tags(reused_pid, {"r1.process_started": f"{float(mine['r1.process_started']) - 3600:.2f}"})
    elsewhere = tracking.start_run("elsewhere", tags={})  # on another host, its heartbeat going: running
    tracking.set_tags(elsewhere, {"r1.host": "another-host", "r1.pid": str(_dead_pid())})
    gone = tracking.start_run("gone", tags={})  # on another host (a pod since preempted): its heartbeat stopped
    heartbeat.stop_beating(gone)
    tracking.set_tags(gone, {"r1.host": "another-host", heartbeat.INTERVAL_TAG: "30",
                             heartbeat.TAG: str(int((time.time() - 5 * 30 - 1) * 1000))})
    alive = tracking.start_run("alive", tags={})  # this very process
    try:
        r1_pipeline(recipe=str(recipe), stages=THREE[:1])  # reused: a start and no training
        status = {name: mlflow_client.get_run(run).info.status for name, run in
                  [("dead", dead), ("reused_pid", reused_pid), ("elsewhere", elsewhere), ("gone", gone),
                   ("alive", alive)]}
        assert status == {"dead": "FAILED", "reused_pid": "FAILED", "elsewhere": "RUNNING", "gone": "FAILED",
                          "alive": "RUNNING"}
        assert "ended without closing" in mlflow_client.get_run(dead).data.tags["r1.ended_because"]
        assert "heartbeat stopped" in mlflow_client.get_run(gone).data.tags["r1.ended_because"]
    finally:
        for run in (elsewhere, alive):
            tracking.end_run(run, "FINISHED")


@pytest.mark.precision  # GRPO under `auto`: resumed and uninterrupted must agree in either precision
def test_a_killed_run_on_a_lost_disk_resumes_from_its_durable_checkpoint_and_ends_as_an_uninterrupted_one(
        prefect_harness, mlflow_client, tmp_path, request, one_thread_everywhere):
    from flows.r1_pipeline import r1_pipeline
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ReasoningGRPOConfig
    from runtime import tracking
    from runtime.durable import newest_copy

    # GRPO needs something to learn, whatever the precision: a cold start that writes the format about half the
    # time (100 steps at a high rate: 2 s in fp32, which it is pinned to, as it is not what this test is about) and
    # room to write it, so groups' rewards spread. With 4 steps' cold start every reward was 0 and GRPO rightly
    # moved nothing under bf16; in fp32 it only seemed to, through Adam stepping on float noise.
    # The fp32 GEMMs are pinned to MKL: the killed run (its own process) and the uninterrupted one (this process)
    # would each time MKL against oneDNN under `auto`, and on an AVX2 CPU, where the two are about even, a busy
    # machine now and then tips one of them to the other library, whose rounding differs (the resumed run keeps
    # the killed run's plan, which is held in tests/grpo/kernels/test_gemm.py)
    grpo = {**GRPO, "grpo": {**GRPO["grpo"], "max_steps": 12, "checkpoint_every": 2, "seed": 12,
                             "sampling": {"max_new_tokens": 48}, "mixed_precision": "auto", "fp32_gemm": "mkl"}}
    cold = {**COLD, "train": {**COLD["train"], "seed": 12, "max_steps": 100, "learning_rate": 1e-2,
                              "warmup_steps": 0, "mixed_precision": "no"}}
    recipe = write_recipe(tmp_path / "killed.yaml", "resume-killed", cold_start_sft=cold, reasoning_grpo=grpo)
    proc = r1_run(recipe, "--stages", "cold_start_sft,reasoning_grpo")

    def grpo_work_dir():
        runs = tracking.find_runs("tags.stage = 'reasoning_grpo' and attributes.status = 'RUNNING'")
        parents = {r.info.run_id for r in tracking.find_runs("tags.recipe = 'resume-killed'")}
        return next((Path(r.data.tags["r1.work_dir.reasoning_grpo"]) for r in runs
                     if r.data.tags.get("mlflow.parentRunId") in parents and "r1.work_dir.reasoning_grpo" in
                     r.data.tags), None)

    def durable_step():  # the step of the newest resume checkpoint copied to the MLflow store and marked complete
        found = newest_copy(work.name)
        return found[1] if found else None

    try:
        work = wait_for("a reasoning_grpo run", grpo_work_dir, proc)
        wait_for("a durable GRPO checkpoint", durable_step, proc, every=0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # kill -9 <pid>: the process only, whatever it started lives on
        proc.wait()
    request.addfinalizer(lambda: kill_group(proc.pid))  # (its reward workers, say, once the test is done)
    step = durable_step()
    assert 2 <= step < 12
    [killed] = tracking.find_runs("tags.recipe = 'resume-killed'")
    killed_runs = children(mlflow_client, killed.info.run_id)
    assert killed.info.status == "RUNNING" and killed_runs["reasoning_grpo"].info.status == "RUNNING"
    # the pod's disk is gone, the tracking server is not: everything under R1_HOME but the MLflow store (and this
    # session's Prefect state) is deleted, work folders and downloaded checkpoints included
    home = tracking.r1_home()
    for item in home.iterdir():
        if not item.name.startswith(("mlflow.db", "mlartifacts", "prefect")):
            shutil.rmtree(item) if item.is_dir() else item.unlink()
    assert not work.exists()

    result = r1_pipeline(recipe=str(recipe), stages=["cold_start_sft", "reasoning_grpo"])

    for run in (killed, killed_runs["reasoning_grpo"]):  # the dead process's runs, closed by the next start
        assert mlflow_client.get_run(run.info.run_id).info.status == "FAILED"
    runs = children(mlflow_client, result.run_id)
    assert runs["cold_start_sft"].data.tags["r1.reused_from"] == killed_runs["cold_start_sft"].info.run_id
    resumed = runs["reasoning_grpo"]
    assert resumed.data.tags["r1.resumed_from_step"] == str(step)  # from the store: the folder was gone
    assert resumed.data.tags["r1.resumed_from_run"] == killed_runs["reasoning_grpo"].info.run_id
    assert resumed.data.tags["r1.work_dir.reasoning_grpo"] == str(work)
    assert newest_copy(work.name) is None  # a finished stage keeps no resume checkpoint: it is reused, not resumed
    history = mlflow_client.get_metric_history(resumed.info.run_id, "reward/total")
    assert sorted(m.step for m in history) == list(range(step + 1, 13))  # only the steps after the checkpoint
    spread = mlflow_client.get_metric_history(resumed.info.run_id, "reward/std")
    assert max(m.value for m in spread) > 0, "no group's rewards differed: GRPO had nothing to learn from"

    # the same stage uninterrupted, from the same cold start: the same weights
    checkpoint = result.stages["cold_start_sft"].uris["checkpoint"]
    whole = reasoning_grpo(checkpoint, ReasoningGRPOConfig.model_validate(grpo))
    assert "r1.resumed_from_step" not in mlflow_client.get_run(whole.run_id).data.tags
    a = weights(result.stages["reasoning_grpo"].uris["checkpoint"], tmp_path / "a")
    b = weights(whole.uris["checkpoint"], tmp_path / "b")
    start = weights(checkpoint, tmp_path / "c")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], start[k]) for k in a)  # GRPO did move the weights


def test_ctrl_c_ends_the_runs_as_killed_and_exits_130(prefect_harness, mlflow_client, tmp_path, capsys):
    import threading

    from flows.cli.r1 import main
    from runtime import tracking

    cold = {**COLD, "train": {**COLD["train"], "seed": 13, "max_steps": 500}}
    recipe = write_recipe(tmp_path / "interrupted.yaml", "resume-interrupted", cold_start_sft=cold)

    def training() -> bool:  # a loss logged: the loop is running, past the stage's start-up
        parents = [r.info.run_id for r in tracking.find_runs("tags.recipe = 'resume-interrupted'")]
        return bool(parents) and any("train/loss" in r.data.metrics for r in tracking.find_runs(
            f"tags.`mlflow.parentRunId` = '{parents[0]}'"))

    def press_ctrl_c():
        deadline = time.monotonic() + 120
        while not training() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c, daemon=True)
    presser.start()
    assert main(["run", "--recipe", str(recipe), "--stages", "cold_start_sft"]) == 130
    presser.join()
    err = [line[line.index("r1:"):] for line in capsys.readouterr().err.splitlines() if "r1:" in line]
    assert len(err) == 1 and "interrupted" in err[0] and "resumes" in err[0]  # (after a progress bar, maybe)
    [parent] = tracking.find_runs("tags.recipe = 'resume-interrupted'")
    assert parent.info.status == "KILLED"
    assert children(mlflow_client, parent.info.run_id)["cold_start_sft"].info.status == "KILLED"


def _two_runs_at_once(tmp_path: Path, env: dict[str, str]) -> list:
    """Two `r1 run` of one recipe started together on one home; both must finish. Returns their parent runs."""
    cold = {**COLD, "train": {**COLD["train"], "checkpoint_every": 2, "seed": 14}}  # a checkpoint at step 2 of 4
    recipe = write_recipe(tmp_path / "twice.yaml", "twice", cold_start_sft=cold)
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    procs = [subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--recipe", str(recipe), "--stages",
                               "cold_start_sft,reasoning_grpo"], cwd=ROOT, env={k: v for k, v in env.items() if v},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outputs = [p.communicate(timeout=400)[0].decode() for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def _check_nothing_crossed(client, outputs: list[str]) -> None:
    import re

    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(experiments, "tags.recipe = 'twice'")
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    # each process reports its own pipeline run
    assert {re.search(r"MLflow pipeline run (\w+)", out).group(1) for out in outputs} == {p.info.run_id
                                                                                         for p in parents}
    trained = []  # (work folder, since when it was held, end) of every stage run that trained
    for parent in parents:
        runs = client.search_runs(experiments, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
        by_stage = {r.data.tags["stage"]: r for r in runs}
        assert len(runs) == 2 and set(by_stage) == {"cold_start_sft", "reasoning_grpo"}
        assert all(r.info.status == "FINISHED" for r in runs)
        cold, grpo = by_stage["cold_start_sft"], by_stage["reasoning_grpo"]
        checkpoint = parent.data.tags["uri.cold_start_checkpoint"]
        # each stage's input is what its own pipeline's stage before it produced (or reused, and says so)
        assert grpo.data.params["input.checkpoint_uri"] == checkpoint
        assert checkpoint == f"runs:/{cold.data.tags.get('r1.reused_from', cold.info.run_id)}/checkpoint"
        # the other pipeline may have finished the same GRPO first: then this one reuses it, and says so
        assert parent.data.tags["uri.reasoning_checkpoint"] == \
            f"runs:/{grpo.data.tags.get('r1.reused_from', grpo.info.run_id)}/checkpoint"
        trained += [(r.data.tags[f"r1.work_dir.{r.data.tags['stage']}"],
                     int(r.data.tags[f"r1.work_dir_since.{r.data.tags['stage']}"]), r.info.end_time)
                    for r in (cold, grpo) if "r1.reused_from" not in r.data.tags]
    # no two runs wrote checkpoints into one work folder at the same time
    for i, (folder, start, end) in enumerate(trained):
        for other, other_start, other_end in trained[i + 1:]:
            assert folder != other or end <= other_start or other_end <= start, folder


def test_two_runs_at_once_on_one_embedded_home(tmp_path):
    from mlflow import MlflowClient

    home = tmp_path / "home"
    outputs = _two_runs_at_once(tmp_path, {"R1_HOME": str(home), "MLFLOW_TRACKING_URI": "", "PREFECT_HOME": "",
                                           "PREFECT_API_URL": ""})
    _check_nothing_crossed(MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}"), outputs)
    # Prefect's links to each flow run name the UI that serves this home (`r1 up`'s, or `prefect server start` on
    # it), not the temporary API's port, where no UI is served and nothing answers once the run ends
    import re

    for out in outputs:
        links = re.findall(r"View at (http://[^/\s]+)/runs/flow-run/", out)
        assert links and set(links) == {"http://127.0.0.1:4200"}, out[-3000:]


def test_two_runs_at_once_against_a_prefect_server_and_an_mlflow_server(deployed_server, tmp_path):
    from mlflow import MlflowClient

    from flows.cli import stack

    mlflow, tracking_uri = stack.start_mlflow_server(tmp_path / "mlflow.db", tmp_path / "mlartifacts",
                                                     stack.free_port(), tmp_path / "logs")
    try:
        outputs = _two_runs_at_once(tmp_path, {"R1_HOME": str(tmp_path / "home"), "MLFLOW_TRACKING_URI": tracking_uri,
                                               "PREFECT_API_URL": deployed_server["api"]})
        _check_nothing_crossed(MlflowClient(tracking_uri=tracking_uri), outputs)
    finally:
        stack.stop_process(mlflow)


def test_a_stage_key_reads_the_files_its_settings_name_and_no_others(tmp_path, monkeypatch):
    # an empty setting (`generation.model: ""`) was read as the working folder: every file under it went into the
    # key (1.6 s of stat calls a stage in this checkout, its virtualenv included), and any write there, a second
    # pytest worker's or R1_HOME's own under it, kept a finished stage from being reused
    from grpo.configs.recipe import ColdStartSFTConfig
    from runtime.reuse import stage_key

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    cfg = ColdStartSFTConfig.model_validate({**COLD, "data": {**COLD["data"], "source": str(data)}})
    assert cfg.generation.model == ""  # the empty setting is there
    key = stage_key("cold_start_sft", cfg, {})
    (tmp_path / "unrelated.log").write_text("written by something else")
    assert stage_key("cold_start_sft", cfg, {}) == key
    data.write_text('{"prompt": "a", "response": "c"}\n{"prompt": "d", "response": "e"}\n')  # the data changed
    assert stage_key("cold_start_sft", cfg, {}) != key


def test_a_damaged_stage_output_is_one_line_and_its_advice_writes_it_again(prefect_harness, mlflow_client, tmp_path):
    """The store loses the end of a finished cold start's weights; the next run that reads them stops with the
    `Fault` line, and what it says to do (the same run with --fresh) writes them again and goes on."""
    from urllib.parse import urlparse

    from flows.r1_pipeline import r1_pipeline
    from grpo.faults import Fault

    cold = {**COLD, "train": {**COLD["train"], "seed": 47}}
    recipe = write_recipe(tmp_path / "damaged.yaml", "damaged", cold_start_sft=cold)
    first = r1_pipeline(recipe=str(recipe), stages=["cold_start_sft"])
    damaged = first.stages["cold_start_sft"]
    stored = (Path(urlparse(mlflow_client.get_run(damaged.run_id).info.artifact_uri).path) / "checkpoint" /
              "model.safetensors")
    stored.write_bytes(stored.read_bytes()[:1000])  # cut short in the store

    stages = ["cold_start_sft", "reasoning_grpo"]
    with pytest.raises(Fault) as e:
        r1_pipeline(recipe=str(recipe), stages=stages)
    assert str(e.value).startswith(f"{damaged.uris['checkpoint']} is damaged: model.safetensors has 1000 bytes")
    assert str(e.value).endswith("the stage that wrote it must run again: add --fresh to the same `r1 run`")

    result = r1_pipeline(recipe=str(recipe), stages=stages, fresh=True)  # `r1 run ... --fresh`
    runs = children(mlflow_client, result.run_id)
    assert {s: r.info.status for s, r in runs.items()} == {"cold_start_sft": "FINISHED", "reasoning_grpo": "FINISHED"}
    assert "r1.reused_from" not in runs["cold_start_sft"].data.tags  # written again, not the damaged one reused
    assert runs["reasoning_grpo"].data.tags["input.checkpoint_uri"] == result.stages["cold_start_sft"].uris["checkpoint"]
