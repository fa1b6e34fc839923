"""The sharded strategy (`distributed.strategy: fsdp`, FSDP2): two CPU processes (gloo, on 127.0.0.1) give what one
process gives at the same global batch, the sampler's gathered copy is the policy, and sharded checkpoints resume on
another process count.

`accelerate launch` starts two real processes of tests/helpers/ddp_loops.py with `fsdp` (SFT, GRPO, PPO, GRPO with
LoRA and activation checkpointing, the reward model, a few steps each on a tiny model); the same functions run here in
one process first. The tolerances are test_distributed.py's (tests/helpers/comparisons.py), for the same reasons (fp32
pinned, the same rows and completions, float32 rounding of two halves' sums only): sharding changes where each
weight's gradient is summed, not what is summed. A shard gathered into the wrong place, a gradient reduced twice or
not at all, or a checkpoint read into the wrong shard would be whole steps of the learning rate away.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comparisons import (assert_curves_match, assert_gradients_of_halves, assert_ppo_matches, assert_same_weights,
                         assert_sft_matches, reported)
from ddp_loops import GRPO, logps_rows, run_all, run_grpo_resumed, run_ppo, run_sft_resumed
from grpo.configs.distributed import DistributedConfig
from grpo.configs.recipe import ReasoningGRPOConfig
from grpo.ports import free_port
from grpo.training.launchers import launch
from processes import HELPERS, ROOT

FSDP = DistributedConfig(strategy="fsdp")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process, two processes): each loop's output folder root. The two-process SFT and GRPO are also resumed
    from the one-process run's step-2 checkpoints (1 -> 2 processes)."""
    one, two = tmp_path_factory.mktemp("fsdp-one"), tmp_path_factory.mktemp("fsdp-two")
    run_all(one, "fsdp")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           str(HELPERS / "ddp_loops.py"), str(two), "fsdp", str(one)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return one, two


def test_chunked_log_probs_inside_the_sharded_root_reduce_every_gradient(runs):
    """token_logps through the chunked head on an FSDP2 model: the head runs inside the root's forward (its
    weights gathered there), no [rows, C, V] logits, and the reduced gradients are the one-process ones."""
    one, two = runs
    single = torch.load(one / "logps" / "rank0.pt")
    assert single["rows"] == logps_rows()[0].size(0)
    assert_gradients_of_halves(single, two, "FSDPQwen2ForCausalLM")


def test_sft_sharded_on_two_processes_matches_one(runs):
    assert_sft_matches(*runs)


def test_sharded_checkpoints_resume_on_another_process_count(runs, tmp_path):
    """Step 2's checkpoint holds each process's shards and one metadata file; one written by one process resumes
    on two, and one written by two resumes on one, each ending where the uninterrupted run ends."""
    one, two = runs
    files = set(reported(two, "sft")[3]["checkpoint_files"])
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "strategy.json", "trainer_state.json"} <= files, files
    assert json.loads((two / "sft-step-2" / "strategy.json").read_text()) == {"strategy": "fsdp", "processes": 2}
    assert sorted(reported(two, "sft-resumed")) == [3]  # 1 -> 2: from the one-process run's step 2
    assert_same_weights(one / "sft" / "model", two / "sft-resumed" / "model", atol=2e-5)
    run_sft_resumed(tmp_path, FSDP, source=two / "sft-step-2")  # 2 -> 1, here
    assert sorted(reported(tmp_path, "sft-resumed")) == [3]
    assert_same_weights(two / "sft" / "model", tmp_path / "sft-resumed" / "model", atol=2e-5)


@pytest.mark.precision
def test_a_sharded_grpo_checkpoint_resumes_on_another_process_count(runs, tmp_path):
    """GRPO's step-2 checkpoint (weights and AdamW state sharded, scheduler) resumed on the other process count
    trains step 3 on the same completions and ends where the uninterrupted run ends."""
    one, two = runs
    assert sorted(reported(two, "grpo-resumed")) == [3]  # 1 -> 2
    assert_same_weights(one / "grpo" / "model", two / "grpo-resumed" / "model", atol=5e-4)
    run_grpo_resumed(tmp_path, FSDP, source=two / "grpo-step-2")  # 2 -> 1, here
    assert sorted(reported(tmp_path, "grpo-resumed")) == [3]
    assert_same_weights(two / "grpo" / "model", tmp_path / "grpo-resumed" / "model", atol=5e-4)


@pytest.mark.precision  # its fp32 verdict must not depend on what `auto` gives here
def test_grpo_sharded_on_two_processes_matches_one_and_samples_the_policy(runs):
    one, two = runs
    a, b = reported(one, "grpo"), reported(two, "grpo")
    assert sorted(a) == list(range(1, GRPO.max_steps + 1))
    assert_curves_match(a, b, ["reward/total", "reward/std", "completion_length", "train/loss", "kl",
                               "grad_norm", "entropy", "clip_ratio"])
    assert a[1]["reward/std"] > 0  # groups had spread: the steps carried a gradient
    assert_same_weights(one / "grpo" / "model", two / "grpo" / "model", atol=5e-4)
    for rank in (0, 1):  # after every optimizer step, the sampler's copy is the policy's whole weights, exactly
        syncs = json.loads((two / "grpo" / f"syncs-rank{rank}.json").read_text())
        assert syncs == [0.0] * GRPO.max_steps, syncs
    gaps = [b[step]["sync/logprob_gap"] for step in sorted(b)]  # checked against the sharded forward every step
    assert all(0 <= g < 1e-5 for g in gaps), gaps
    assert "sync/logprob_gap" not in a[1]  # one process samples from the policy itself: nothing to compare


def test_grpo_with_lora_and_checkpointing_sharded_matches_one(runs):
    one, two = runs
    a, b = reported(one, "grpo-lora"), reported(two, "grpo-lora")
    assert_curves_match(a, b, ["reward/total", "train/loss", "kl", "grad_norm", "entropy"])
    assert a[3]["kl"] > 0  # the adapters moved the policy off the reference (the base with them off)
    assert_same_weights(one / "grpo-lora" / "model", two / "grpo-lora" / "model", atol=5e-4)
    assert json.loads((two / "grpo-lora" / "syncs-rank1.json").read_text()) == [0.0] * GRPO.max_steps


@pytest.mark.precision
def test_ppo_policy_and_critic_sharded_match_one_process(runs):
    """PPO's two models, each sharded with its own optimizer: two processes train as one, and the sampler's copy
    is the policy after every step."""
    assert_ppo_matches(*runs)
    assert json.loads((runs[1] / "ppo" / "syncs-rank1.json").read_text()) == [0.0] * GRPO.max_steps


@pytest.mark.precision
def test_a_sharded_ppo_checkpoint_resumes_policy_and_critic_on_another_process_count(runs, tmp_path):
    """PPO's step-2 checkpoint holds both models' shards and both optimizers' (and schedulers): resumed on the
    other process count, step 3 ends where the uninterrupted run ends, critic included."""
    one, two = runs
    files = set(reported(two, "ppo")[3]["checkpoint_files"])
    assert {"__0_0.distcp", "__1_0.distcp", "scheduler.pt", "scheduler-1.pt", "strategy.json"} <= files, files
    for resumed, whole in ((two, one), (tmp_path, two)):  # 1 -> 2 (in the launch), then 2 -> 1 here
        if resumed is tmp_path:
            run_ppo(tmp_path, FSDP, source=two / "ppo-step-2")
        assert sorted(reported(resumed, "ppo-resumed")) == [3]
        assert_same_weights(whole / "ppo" / "model", resumed / "ppo-resumed" / "model", atol=5e-4)
        critic, want = (torch.load(r / "critic-rank0.pt") for r in (resumed / "ppo-resumed", whole / "ppo"))
        for name in want:
            torch.testing.assert_close(critic[name], want[name], rtol=0, atol=5e-4, msg=name)


def test_reward_model_sharded_on_two_processes_matches_one(runs):
    one, two = runs
    a, b = reported(one, "rm"), reported(two, "rm")
    assert_curves_match(a, b, ["rm/loss", "rm/accuracy", "rm/margin", "rm/grad_norm"])


@pytest.mark.parametrize("section, says", [
    ({"distributed": {"strategy": "fsdp"}, "grpo": {"weights_dtype": "bfloat16"}},
     "grpo.weights_dtype bfloat16 keeps fp32 master weights"),
    ({"distributed": {"strategy": "fsdp"}, "grpo": {"optimizer": "adamw_8bit"}},
     "grpo.optimizer adamw_8bit (bitsandbytes) cannot step sharded weights"),
    ({"distributed": {"strategy": "fsdp", "config_file": "x.yaml"}}, "config_file (an accelerate config file)"),
    ({"distributed": {"strategy": "zero3"}}, "strategy"),
])
def test_what_the_sharded_strategy_cannot_honour_is_refused_when_the_recipe_is_read(section, says):
    with pytest.raises(ValueError, match=None) as e:
        ReasoningGRPOConfig.model_validate(section)
    assert says in str(e.value)


def test_a_checkpoint_of_another_strategy_is_refused_in_one_line(tmp_path):
    from grpo.training.accelerator import make_accelerator
    from grpo.training.strategy import STRATEGY_FILE, make_strategy

    folder = tmp_path / "step-2"
    folder.mkdir()
    (folder / STRATEGY_FILE).write_text(json.dumps({"strategy": "ddp", "processes": 2}))
    with pytest.raises(ValueError, match=r"step-2: a ddp checkpoint cannot be resumed with distributed.strategy "
                                         r"fsdp; set the strategy it was written with"):
        make_strategy(make_accelerator("no"), FSDP).load_state(folder)


def test_a_sharded_stage_killed_on_two_processes_resumes_on_one_from_its_durable_checkpoint(
        prefect_harness, mlflow_client, tmp_path, request):
    """A real `r1 run` of cold-start SFT on two FSDP processes, killed with SIGKILL (it and the processes it
    launched) once a sharded checkpoint is in the MLflow store and the local work folder lost with the machine; the
    stage again on one process resumes from that copy and ends with the weights of an uninterrupted one-process run.
    (GRPO's own resume across process counts is held above, at the loop: a stage samples with a stream per process,
    so its completions, not its checkpoints, depend on the process count.)"""
    import shutil
    import signal

    import yaml

    from flows.cold_start_sft import cold_start_sft
    from flows.r1_pipeline import r1_pipeline
    from grpo.configs.recipe import ColdStartSFTConfig
    from processes import kill_group, r1_run, wait_for
    from runs import children, weights
    from runtime import tracking
    from runtime.durable import newest_copy
    from tiny_configs import TINY

    section = {"model": {"tiny": TINY},
               "data": {"num_train": 64, "num_heldout": 0},
               "train": {"max_steps": 30, "batch_size": 8, "log_every": 2, "checkpoint_every": 2, "seed": 15,
                         "mixed_precision": "no"},
               "distributed": {"num_processes": 2, "strategy": "fsdp"}}
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({"name": "fsdp-killed", "cold_start_sft": section}))
    proc = r1_run(two, "--stages", "cold_start_sft")
    request.addfinalizer(lambda: kill_group(proc.pid))

    def work_dir():
        runs = tracking.find_runs("tags.stage = 'cold_start_sft' and attributes.status = 'RUNNING'")
        parents = {r.info.run_id for r in tracking.find_runs("tags.recipe = 'fsdp-killed'")}
        return next((Path(r.data.tags["r1.work_dir.cold_start_sft"]) for r in runs
                     if r.data.tags.get("mlflow.parentRunId") in parents
                     and "r1.work_dir.cold_start_sft" in r.data.tags), None)

    work = wait_for("a cold_start_sft run", work_dir, proc)
    wait_for("a durable sharded checkpoint", lambda: newest_copy(work.name), proc, every=0.05)
    import psutil

    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 4, family  # r1, the launcher and both training processes (and their helpers)
    for p in family:  # the machine is lost: every process of the stage dies at once
        p.kill()
    psutil.wait_procs(family, timeout=30)
    proc.wait()
    _, step = newest_copy(work.name)
    assert 2 <= step < 30
    shutil.rmtree(work)  # the machine's disk went with it: only the MLflow store's copy is left

    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({"name": "fsdp-killed", "cold_start_sft": {
        **section, "distributed": {"num_processes": 1, "strategy": "fsdp"}}}))
    result = r1_pipeline(recipe=str(one), stages=["cold_start_sft"])
    resumed = children(mlflow_client, result.run_id)["cold_start_sft"]
    assert resumed.data.tags["r1.resumed_from_step"] == str(step)
    assert resumed.data.tags["r1.work_dir.cold_start_sft"] == str(work)  # the same key on one process
    history = mlflow_client.get_metric_history(resumed.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(step + 2, 31, 2))
    for run in tracking.find_runs("tags.recipe = 'fsdp-killed'"):  # the killed ones closed by the next start
        assert run.info.status in ("FINISHED", "FAILED"), run.info.run_id

    whole = cold_start_sft(ColdStartSFTConfig.model_validate({**section, "distributed": {"num_processes": 1}}))
    a = weights(result.stages["cold_start_sft"].uris["checkpoint"], tmp_path / "a")
    b = weights(whole.uris["checkpoint"], tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-5, msg=k)


HANGS = """
import os, sys, time
import torch
from grpo.configs.distributed import DistributedConfig
from grpo.training.accelerator import make_accelerator
from grpo.training.strategy import make_strategy
from ddp_loops import SMALL
from grpo.models import load_model_and_tokenizer

acc = make_accelerator("no")
model, tok = load_model_and_tokenizer(SMALL)
strategy = make_strategy(acc, DistributedConfig(strategy="fsdp"))
model = strategy.prepare(model)
strategy.sampler_model()  # gathered once by both
if acc.process_index == 1:
    time.sleep(120)  # a process that stopped answering (a hung GPU, a lost link)
started = time.monotonic()
try:
    strategy.sync_sampler()
except Exception as e:
    print(f"rank 0 gave up after {time.monotonic() - started:.0f} s: {type(e).__name__}", flush=True)
    os._exit(3)
"""


def test_a_gather_that_waits_past_the_collective_timeout_fails_instead_of_hanging(tmp_path):
    """The sampler's gather is a collective under the process group's timeout (distributed.collective_timeout_s,
    passed to the loops as R1_COLLECTIVE_TIMEOUT_S): with the other process gone quiet, it fails in about that
    time, so the stage can fail and be retried, never a silent hang."""
    import time

    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "", launch.COLLECTIVE_TIMEOUT: "10",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HELPERS), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), str(script)],
                          env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    assert proc.returncode != 0
    said = [line for line in proc.stdout.splitlines() if line.startswith("rank 0 gave up")]
    assert said, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert 8 <= int(said[0].split()[5]) <= 60, said  # about the timeout, not the sleeping process's 120 s
    assert took < 115, took  # the launch ended on the failure, not when the quiet process woke
