"""Training across processes: two CPU processes (gloo, on 127.0.0.1) give what one process gives at the same
global batch, and only the main one reports and saves.

`accelerate launch` starts two real processes of tests/helpers/ddp_loops.py (SFT, GRPO, PPO and the reward model, a
few steps each on a tiny model); the same functions then run here in one process. Tolerances: both runs see the same
rows (GRPO: the same completions, tests/helpers/ddp_loops.py says how) and start from the same weights, so they differ
only in float32 rounding (every loop here pins fp32, whatever `auto` gives on this CPU): DDP sums the gradient from two
halves, a token mean is two partial sums. That is ~1e-7 relative per operation, a few 1e-6 after three Adam steps;
the checks allow 1e-4 relative on metrics, and on weights 2e-5 absolute (SFT) or 5e-4 (GRPO, lr 1e-2). Adam divides
each gradient by its own size, so a near-zero gradient whose rounding differs between the two sums moves its weight
by up to a whole step of the learning rate, and how matmuls sum differs between CPUs (AVX-512 machines blocked the
halves otherwise and gave 1.7e-4 where AVX2 ones gave under 1e-4): 5e-4 is 5% of one step, where a lost, doubled or
reversed step is a whole one. One wrong normalisation is far outside the metrics' 1e-4: a token mean taken per process instead of over the whole batch moves the
gradient norm by ~4% at the first or second step, in SFT and in GRPO's dapo loss alike (checked by breaking it).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from comparisons import (RTOL, assert_curves_match, assert_gradients_of_halves, assert_ppo_matches, assert_same_weights,
                         assert_sft_matches, reported)
from ddp_loops import GRPO, logps_rows, run_all
from grpo.configs.distributed import DistributedConfig
from grpo.ports import free_port
from grpo.training.launchers import launch
from processes import HELPERS, ROOT, launch_two_processes
from tiny_configs import DISTRIBUTED_STAGE as STAGE


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process, two processes): each loop's output folder root."""
    one, two = tmp_path_factory.mktemp("one-process"), tmp_path_factory.mktemp("two-processes")
    launch_two_processes(HELPERS / "ddp_loops.py", two)
    run_all(one)
    return one, two


def test_chunked_log_probs_under_ddp_sync_every_gradient(runs):
    """token_logps through the chunked head on a DDP-wrapped model: no [rows, C, V] logits, and after the
    backward both processes hold the one-process gradients of all the rows, the (tied) head's included: DDP's
    all-reduce saw every use of every weight."""
    one, two = runs
    single = torch.load(one / "logps" / "rank0.pt")
    ids, _, C = logps_rows()
    assert single["wrapper"] != "DistributedDataParallel" and single["rows"] == ids.size(0)
    assert_gradients_of_halves(single, two, "DistributedDataParallel")


def test_sft_on_two_processes_matches_one(runs):
    assert_sft_matches(*runs)


def test_checkpoints_hold_every_process_state_once(runs):
    _, two = runs
    files = reported(two, "sft")[3]["checkpoint_files"]  # step-2's folder as rank 0 saw it at step 3
    assert {"random_states_0.pkl", "random_states_1.pkl", "trainer_state.json", "optimizer.bin"} <= set(files)
    assert len([f for f in files if f.startswith(("pytorch_model", "model"))]) == 1, files
    assert not (two / "sft" / "checkpoints").exists()  # the finished run cleared them, once


def test_a_run_resumed_on_two_processes_ends_where_the_whole_run_ends(runs):
    _, two = runs
    assert sorted(reported(two, "sft-resumed")) == [3]  # it started from the step-2 checkpoint
    assert_same_weights(two / "sft" / "model", two / "sft-resumed" / "model", atol=1e-6)


@pytest.mark.precision  # named in the any-CPU work: its fp32 verdict must not depend on what `auto` gives here
def test_grpo_on_two_processes_matches_one(runs):
    one, two = runs
    a, b = reported(one, "grpo"), reported(two, "grpo")
    assert sorted(a) == list(range(1, GRPO.max_steps + 1))
    # sampled completions, rewards and the loss over the global batch of 4 prompts x 4 completions
    assert_curves_match(a, b, ["reward/total", "reward/std", "completion_length", "train/loss", "kl",
                               "grad_norm", "entropy", "clip_ratio"])
    assert a[1]["reward/std"] > 0  # groups had spread: the steps carried a gradient
    assert_same_weights(one / "grpo" / "model", two / "grpo" / "model", atol=5e-4)
    for step in (1, 2, 3):  # the samples table holds every process's groups
        table_one, table_two = (pd.read_json(r / "grpo" / f"samples-{step}.json") for r in runs)
        assert len(table_two) == GRPO.prompts_per_step * GRPO.num_generations
        assert table_two["completion"].tolist() == table_one["completion"].tolist()


@pytest.mark.precision
def test_ppo_with_its_critic_on_two_processes_matches_one(runs):
    assert_ppo_matches(*runs)


def test_reward_model_on_two_processes_matches_one(runs):
    one, two = runs
    a, b = reported(one, "rm"), reported(two, "rm")
    assert_curves_match(a, b, ["rm/loss", "rm/accuracy", "rm/margin", "rm/grad_norm"])


def test_a_batch_that_cannot_split_is_refused_before_training():
    with pytest.raises(ValueError, match=r"grpo.prompts_per_step \(6\) must be a multiple of "
                                         r"distributed.num_processes \(4\)"):
        launch.check_splits(DistributedConfig(num_processes=4), grpo__prompts_per_step=6)
    assert launch.check_splits(DistributedConfig(num_processes="auto"), grpo__prompts_per_step=3) == max(
        torch.cuda.device_count(), 1)


def test_the_task_follows_what_the_main_process_reports(tmp_path):
    """The worker's event lines reach the task's callbacks as metrics and tables, a torn last line waits."""
    from grpo.training.launchers.worker import EventWriter

    events = tmp_path / "events.jsonl"
    writer = EventWriter(events)
    writer.metrics(1, {"train/loss": 0.5})
    writer.samples(1, pd.DataFrame({"prompt": ["p"], "completion": ["c"], "reward": [1.0]}))
    writer.metrics(1, {"train/loss": 0.5})  # step 1 again (workers restarted from a checkpoint): passed on once
    with events.open("a") as f:
        f.write('{"step": 2, "metr')  # a line still being written when the launch ended: not a whole event
    seen = []
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    launch._follow(lambda: done.poll() is not None, events, lambda step, m: seen.append((step, m)),
                   lambda step, t: seen.append((step, t)))
    assert seen[0] == (1, {"train/loss": 0.5})
    assert seen[1][1].to_dict("list") == {"prompt": ["p"], "completion": ["c"], "reward": [1.0]}
    assert len(seen) == 2


def test_a_stage_trains_on_two_processes_and_only_its_task_logs(prefect_harness, mlflow_client, tmp_path):
    """`distributed: {num_processes: 2}` in a stage's recipe section: the Prefect task launches the loop, follows
    rank 0's reports into its one MLflow run, and the result is the one-process training of the same rows."""
    import time

    from flows.cold_start_sft import cold_start_sft
    from grpo.configs.recipe import ColdStartSFTConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft
    from tasks.data import read_frame

    cfg = ColdStartSFTConfig.model_validate(STAGE)
    since = int(time.time() * 1000)
    result = cold_start_sft(cfg)
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    made = mlflow_client.search_runs([e.experiment_id for e in mlflow_client.search_experiments()],
                                     f"attributes.start_time >= {since}")
    assert [r.info.run_id for r in made] == [result.run_id]  # the launched processes made no run of their own
    losses = mlflow_client.get_metric_history(result.run_id, "train/loss")
    assert [m.step for m in losses] == [2, 4]  # once per logging step: one process reported
    assert "eval/accuracy" in run.data.metrics  # evaluated in the task's process after training

    seen = {}
    model, tok = load_model_and_tokenizer(cfg.model)
    train_sft(model, tok, read_frame(result.uris["dataset"]), cfg.train, tmp_path,
              lambda step, m: seen.__setitem__(step, m["train/loss"]), progress=False)
    assert [m.value for m in losses] == pytest.approx([seen[2], seen[4]], rel=RTOL)


def test_two_machines_on_loopback_train_one_stage_together(prefect_harness, mlflow_client, tmp_path, monkeypatch):
    """`distributed: {num_machines: 2, strategy: fsdp}`: the stage's task on machine 0 starts its process and
    announces the job; a second machine (here another process tree on 127.0.0.1, `python -m grpo.training.launchers.join`
    with R1_MACHINE_RANK=1) starts the other; the two processes train one sharded SFT together, the task logs rank
    0's reports into its one run, and the result is the one-process training of the same rows."""
    from flows.cold_start_sft import cold_start_sft
    from grpo.configs.recipe import ColdStartSFTConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft
    from tasks.data import read_frame

    job = {launch.JOIN_DIR: str(tmp_path / "join"), launch.MAIN_IP: "127.0.0.1",
           launch.MAIN_PORT: str(free_port())}
    for key, value in job.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(launch.MACHINE_RANK, "0")
    env = {**os.environ, **job, launch.MACHINE_RANK: "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    peer = subprocess.Popen([sys.executable, "-m", "grpo.training.launchers.join", "--timeout-s", "300"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        cfg = ColdStartSFTConfig.model_validate({**STAGE, "train": {**STAGE["train"], "seed": 21},
                                                 "distributed": {"num_processes": 1, "num_machines": 2,
                                                                 "strategy": "fsdp"}})
        result = cold_start_sft(cfg)
        output = peer.communicate(timeout=120)[0]
    finally:
        peer.kill()
    assert peer.returncode == 0, output[-3000:]
    assert "machine 1 of 2" in output and "--machine_rank 1" in output
    assert not (tmp_path / "join" / launch.ANNOUNCEMENT).exists()  # the finished job is no longer announced
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    losses = mlflow_client.get_metric_history(result.run_id, "train/loss")
    assert [m.step for m in losses] == [2, 4]

    seen = {}
    model, tok = load_model_and_tokenizer(cfg.model)
    train_sft(model, tok, read_frame(result.uris["dataset"]), cfg.train, tmp_path / "one",
              lambda step, m: seen.__setitem__(step, m["train/loss"]), progress=False)
    assert [m.value for m in losses] == pytest.approx([seen[2], seen[4]], rel=RTOL)


def test_a_multi_machine_stage_without_its_job_settings_is_refused_before_training(monkeypatch):
    for key in (launch.MAIN_IP, launch.JOIN_DIR, launch.MACHINE_RANK):
        monkeypatch.delenv(key, raising=False)
    two = DistributedConfig(num_machines=2)
    with pytest.raises(ValueError, match="R1_MAIN_PROCESS_IP must name machine 0's address"):
        launch.check_splits(two, train__batch_size=8)
    monkeypatch.setenv(launch.MAIN_IP, "10.0.0.1")
    with pytest.raises(ValueError, match="needs R1_JOIN_DIR: a folder every machine of the job mounts"):
        launch.check_splits(two, train__batch_size=8)
    monkeypatch.setenv(launch.MACHINE_RANK, "2")
    with pytest.raises(ValueError, match=r"R1_MACHINE_RANK='2': expected a machine rank from 0 to 1"):
        launch.check_splits(two, train__batch_size=8)
    with pytest.raises(ValueError, match=r"train.batch_size \(6\) must be a multiple of distributed.num_processes "
                                         r"\(4\)"):
        launch.check_splits(DistributedConfig(num_processes=2, num_machines=2), train__batch_size=6)
