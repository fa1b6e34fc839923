"""Asynchronous GRPO (`rollout.mode: async`): sampler processes apart from the trainer, a bound on staleness kept at
both ends, the synchronous algorithm at max_staleness 0, and workers that die or stop replaced.

Real spawned processes, a real tiny model; fp32 and one thread a process wherever numbers are compared."""

import copy
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo.configs.rollout import RolloutConfig
from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.engines import build_engine
from grpo.training.batches import prompt_order
from grpo.training.distributed import sampling_seed
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.rollouts import FAULT_POINTS, FAULTS, FAULTS_DIR, Plan, RolloutError, Unit, worker_steps
from grpo.training.rollouts.processes import ProcessRollouts
from rollout_runs import PROMPTS, digits, run, weights
from tiny_configs import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread, as each worker has (conftest)


def test_worker_steps_cover_every_step_once():
    assert [list(worker_steps(w, 3, 4, 12)) for w in range(3)] == [[6, 9], [4, 7, 10], [5, 8, 11]]
    assert sorted(s for w in range(3) for s in worker_steps(w, 3, 4, 12)) == list(range(4, 12))


def test_max_staleness_0_trains_the_weights_the_synchronous_loop_trains(tmp_path):
    """Same seeds: the sampler process draws the synchronous loop's tokens from the same weights, so after three
    steps every weight is equal, bit for bit (the synchronous run with the behaviour weight's cap as its TIS)."""
    seen_sync, seen_async = {}, {}
    sync = run(tmp_path / "sync", seen=seen_sync, tis_cap=2.0)
    asynchronous = run(tmp_path / "async", seen=seen_async,
                       rollout=RolloutConfig(mode="async", max_staleness=0, threads=1))
    a, b = weights(sync), weights(asynchronous)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    assert [seen_sync[s]["reward/total"] for s in (1, 2, 3)] == [seen_async[s]["reward/total"] for s in (1, 2, 3)]
    assert all(seen_async[s]["async/staleness_max"] == 0 for s in (1, 2, 3))
    # no weights changed between sampling and training: the behaviour weight is 1 on every token, top-p on
    # (the sampler records the tempered full distribution's log-prob, as the trainer computes it)
    for s in (1, 2, 3):
        assert seen_async[s]["tis/logp_diff_max"] < 1e-4 and seen_async[s]["tis/truncated_share"] == 0
        assert seen_async[s]["tis/weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_the_reference_scored_on_the_sampler_gives_the_synchronous_weights(tmp_path):
    """rollout.reference sampler: the worker scores the KL term's reference log-probs with the trainer's kernels and
    micro-batches, so at max_staleness 0 the weights after three steps still equal the synchronous loop's, bit for
    bit, and the trainer keeps no reference of its own."""
    sync = run(tmp_path / "sync", tis_cap=2.0)
    on = run(tmp_path / "async", rollout=RolloutConfig(mode="async", max_staleness=0, threads=1,
                                                       reference="sampler"))
    assert on.ref_model is None
    a, b = weights(sync), weights(on)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]


# -- the bound, kept by the producer and checked by the consumer ------------------------------------------------------

class Slow:
    """A worker's engine that waits a random while before each call: samplers of uneven speed."""

    def __init__(self, engine):
        self.engine, self.rng = engine, random.Random(os.getpid())

    def generate(self, *args, **kwargs):
        time.sleep(self.rng.uniform(0.0, 0.08))
        return self.engine.generate(*args, **kwargs)

    def sync_weights(self):
        self.engine.sync_weights()


def slow(engine):
    return Slow(engine)


def plan(max_staleness: int, steps: int, wrapper=None) -> Plan:
    return Plan(PROMPTS["prompt"].tolist(), 2, 2, SamplingConfig(max_new_tokens=4, temperature=1.0),
                GenerationConfig(), 0, 1, max_staleness, steps, None, None, False, wrapper)


def workers_for(model, tok, max_staleness, steps, n=2, wrapper=None, **kw) -> ProcessRollouts:
    cfg = RolloutConfig(mode="async", max_staleness=max_staleness, workers=n, threads=1, **kw)
    return ProcessRollouts(cfg, plan(max_staleness, steps, wrapper), model, tok, first_step=0, timeout_s=60.0,
                          devices=["cpu"] * n)


def rollout_children() -> list:
    return [p for p in mp.active_children() if p.name.startswith("r1-rollout")]


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_every_consumed_group_is_within_the_bound_under_random_delays(max_staleness):
    """Two workers of random speed, a trainer of random speed pushing after every step: every unit taken was sampled
    at most max_staleness steps before, and where the bound allows it the samplers did run ahead."""
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    rng, steps = random.Random(max_staleness), 10
    workers = workers_for(model, tok, max_staleness, steps, wrapper=slow)
    workers.start(model, 0)
    try:
        for step in range(steps):
            unit = workers.take(step)
            assert unit.step == step and 0 <= step - unit.version <= max_staleness
            time.sleep(rng.uniform(0.0, 0.15))  # the trainer's step
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            workers.push(model, step + 1)
    finally:
        workers.close()
    assert len(workers.consumed_staleness) == steps and max(workers.consumed_staleness) <= max_staleness
    if max_staleness:
        assert max(workers.consumed_staleness) >= 1, "the samplers should have run ahead of a slow trainer"
    assert rollout_children() == []


def test_a_unit_past_the_bound_is_a_stage_error_and_is_not_handed_out():
    model, tok = load_model_and_tokenizer(SMALL)
    workers = workers_for(model, tok, 1, 10, n=1)
    stale = Unit(5, 3, None, 0, 0.0, 0.0)  # sampled by version 3, trained at version 5: two steps behind
    workers.received[5] = stale
    with pytest.raises(RolloutError, match=r"version 3, 2 optimizer steps behind .*max_staleness 1"):
        workers.take(5)
    assert workers.consumed_staleness == []


def test_a_push_leaves_nothing_of_the_old_weights_in_use():
    """A worker that sampled under version 0 samples under the pushed weights exactly what a fresh engine on them
    samples with the same seed: no KV cache, prefill or bf16 copy of the old weights survives the push."""
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    workers = workers_for(model, tok, 0, 2, n=1)
    workers.start(model, 0)
    try:
        workers.take(0)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        workers.push(model, 1)
        unit = workers.take(1)
    finally:
        workers.close()
    assert unit.version == 1
    fresh = build_engine(GenerationConfig(), copy.deepcopy(model).eval(), tok)
    p = plan(0, 2)
    torch.manual_seed(sampling_seed(0, 1, 0))
    want = fresh.generate([p.cells[i] for i in prompt_order(len(p.cells), 1, 2, 0)], 2, p.sampling, logprobs=True)
    assert torch.equal(unit.rollout.completion_ids, want.completion_ids) and unit.rollout.texts == want.texts


# -- faults -----------------------------------------------------------------------------------------------------------

def kill_at_step_1(signum, sent: list | None = None):
    """A reward that, scoring step 1, sends `signum` to the rollout worker (and rewards digits); the time it did
    into `sent`."""
    calls = []

    def reward(completions, **_):
        calls.append(1)
        if len(calls) == 2:
            for p in rollout_children():
                os.kill(p.pid, signum)
            if sent is not None:
                sent.append(time.time())
        return digits(completions)
    return reward


@pytest.mark.parametrize("signum, timeout_s", [(signal.SIGKILL, 60.0), (signal.SIGSTOP, 3.0)])
def test_a_killed_or_stopped_worker_is_named_and_replaced_and_the_stage_finishes(tmp_path, caplog, signum,
                                                                                   timeout_s):
    seen = {}
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(max_steps=4, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                     sampling=SamplingConfig(max_new_tokens=8), rewards={"digits": 1.0}, mixed_precision="no",
                     rollout=RolloutConfig(mode="async", max_staleness=1, threads=1, timeout_s=timeout_s))
    sent = []
    trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, progress=False,
                          reward_functions={"digits": kill_at_step_1(signum, sent)},
                          on_metrics=lambda step, m: seen.__setitem__(step, m))
    with caplog.at_level("WARNING", logger="grpo.training.rollouts"):
        trainer.train()
    records = [r for r in caplog.records if "rollout worker" in r.getMessage()]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1 and "replaced by a new one" in lines[0], lines
    assert ("died (SIGKILL)" if signum == signal.SIGKILL else "gave no sign of life") in lines[0]
    assert sorted(seen) == [1, 2, 3, 4] and seen[4]["async/restarts"] == 1
    assert all(seen[s]["async/staleness_max"] <= 1 for s in seen)
    if signum == signal.SIGSTOP:  # named in about the timeout (3 s), not after the collective timeout
        assert timeout_s - 1.5 <= records[0].created - sent[0] < timeout_s + 5  # its last beat <= 1 s before
    assert rollout_children() == []


def test_a_worker_stopped_before_its_first_heartbeat_is_replaced_within_the_timeout(caplog):
    """A sampler stopped (SIGSTOP) while it starts, before its heartbeat beats, is named and replaced within the
    timeout, not after the grace a starting process gets (STARTUP_S, 120 s): the system says it is stopped."""
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    for attempt in range(3):  # the stop must land before the first beat, which comes a few hundred ms after start
        workers = ProcessRollouts(RolloutConfig(mode="async", max_staleness=0, workers=1, threads=1, timeout_s=2.0),
                                  plan(0, 1), model, tok, first_step=0, timeout_s=2.0, devices=["cpu"])
        workers.start(model, 0)
        first = workers.workers[0].process
        os.kill(first.pid, signal.SIGSTOP)
        if workers.beats[0] < 0:
            break
        workers.close()
    else:
        pytest.fail("the worker beat before it could be stopped, three times")
    try:
        t0 = time.time()
        with caplog.at_level("WARNING", logger="grpo.training.rollouts"):
            unit = workers.take(0)
        took = time.time() - t0
    finally:
        workers.close()
    lines = [r.getMessage() for r in caplog.records if "rollout worker" in r.getMessage()]
    assert len(lines) == 1 and "was stopped before its first heartbeat" in lines[0], lines
    assert unit.version == 0 and workers.restarts == 1 and first.exitcode is not None
    assert took < 60, took  # the timeout, a new process and its sampling; before, STARTUP_S (120 s) first
    assert rollout_children() == []


@pytest.mark.parametrize("action", ["stop", "kill"])
def test_a_worker_stopped_or_killed_at_every_point_of_the_protocol_is_replaced_and_trains_the_same(
        tmp_path, monkeypatch, caplog, action):
    """The sampler stops (SIGSTOP) or dies (SIGKILL) at each point of the protocol in turn, each fault once: before it
    builds its policy, before its first weights, before a unit, halfway through writing one (the trainer once hung
    for ever in the read of its rest), after one, before a later push's weights, after its last unit. Each is named
    and replaced within the timeout, the run ends, and it trains the weights the synchronous loop trains."""
    fired = tmp_path / "fired"
    fired.mkdir()
    monkeypatch.setenv(FAULTS, ",".join(f"{point}:{action}" for point in FAULT_POINTS))
    monkeypatch.setenv(FAULTS_DIR, str(fired))
    sync = run(tmp_path / "sync", tis_cap=2.0)
    t0 = time.time()
    with caplog.at_level("WARNING", logger="grpo.training.rollouts"):
        faulty = run(tmp_path / "async", rollout=RolloutConfig(mode="async", max_staleness=0, threads=1, timeout_s=2.0,
                                                               max_restarts=len(FAULT_POINTS)))
    took = time.time() - t0
    assert sorted(os.listdir(fired)) == sorted(f"{point}-{action}" for point in FAULT_POINTS)  # every one fired
    records = [r for r in caplog.records if "rollout worker" in r.getMessage()]
    lines = [r.getMessage() for r in records]
    # "shutdown" comes after the last unit: the run may end before its worker is found silent
    assert len(FAULT_POINTS) - 1 <= len(lines) <= len(FAULT_POINTS), lines
    assert all(("gave no sign of life" if action == "stop" else "died (SIGKILL)") in line for line in lines), lines
    assert not any("Traceback" in r.getMessage() or r.exc_info for r in caplog.records)
    # each fault named within the timeout (its last heartbeat up to a second before) and a margin, in order
    when = sorted((fired / name).stat().st_mtime for name in os.listdir(fired))
    for fault_at, record in zip(when, records):
        assert 0 <= record.created - fault_at < 2.0 + 5, (record.created - fault_at, record.getMessage())
    a, b = weights(sync), weights(faulty)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    assert rollout_children() == []
    # a bound on a hang, not a speed check: each fault costs its timeout and a new process
    assert took < len(FAULT_POINTS) * 60, took


def test_a_trainer_paused_past_the_timeout_keeps_its_workers_and_their_bound(tmp_path, caplog):
    """The trainer itself stopped (SIGSTOP, from a helper process) for three timeouts mid-run, then continued: its
    workers, which went on beating, are not taken for silent; none gives up, and no unit trained is past the bound."""
    seen, calls = {}, []

    def reward(completions, **_):
        calls.append(1)
        if len(calls) == 2:  # scoring step 1: stopped for 9 s, continued by the helper
            subprocess.Popen(["sh", "-c", f"kill -STOP {os.getpid()}; sleep 9; kill -CONT {os.getpid()}"])
            time.sleep(0.5)  # stopped within it
        return digits(completions)

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(max_steps=4, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                     sampling=SamplingConfig(max_new_tokens=8), rewards={"digits": 1.0}, mixed_precision="no",
                     rollout=RolloutConfig(mode="async", max_staleness=1, threads=1, timeout_s=3.0))
    trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, progress=False, reward_functions={"digits": reward},
                          on_metrics=lambda step, m: seen.__setitem__(step, m))
    t0 = time.time()
    with caplog.at_level("WARNING", logger="grpo.training.rollouts"):
        trainer.train()
    assert time.time() - t0 > 9  # it was stopped
    assert not [r.getMessage() for r in caplog.records if "rollout worker" in r.getMessage()]
    assert sorted(seen) == [1, 2, 3, 4] and seen[4]["async/restarts"] == 0
    assert all(seen[s]["async/staleness_max"] <= 1 for s in seen)
    assert rollout_children() == []


TRAINER = """
import sys
from pathlib import Path
sys.path[:0] = {paths!r}
from grpo.configs.rollout import RolloutConfig
from rollout_runs import run

if __name__ == "__main__":
    marker = Path({marker!r})
    run({folder!r}, steps=500, on_metrics_hook=lambda step, m: marker.write_text(str(step)),
        rollout=RolloutConfig(mode="async", max_staleness=1, threads=1, timeout_s=3.0))
"""


def test_a_trainer_killed_leaves_no_worker_behind(tmp_path):
    """SIGKILL to the trainer's process once it has trained on its sampler's units: the sampler process ends with it
    (the kernel's parent-death signal, and the heartbeat's check of the trainer), within the timeout, and so does
    the fork server it was forked from."""
    import psutil

    root = Path(__file__).resolve().parents[3]
    script, marker = tmp_path / "trainer.py", tmp_path / "trained"
    script.write_text(TRAINER.format(paths=[str(root / "tests" / "helpers"), str(root)], marker=str(marker),
                                     folder=str(tmp_path / "run")))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while not marker.exists() and time.time() < deadline and trainer.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), trainer.communicate(timeout=30)[1][-3000:] if trainer.poll() is not None else "slow"
        # the samplers, and the fork server they were forked from (multiprocessing's, where the system has one)
        started = [c for c in psutil.Process(trainer.pid).children(recursive=True)
                   if any(m in " ".join(c.cmdline()) for m in ("forkserver", "spawn_main"))]
        workers = [c for c in started if c.ppid() != trainer.pid or "spawn_main" in " ".join(c.cmdline())]
        assert workers, "no sampler process"
        workers = started
        trainer.kill()
        trainer.wait(30)
        _, left = psutil.wait_procs(workers, timeout=3.0 + 5.0)  # the run's timeout_s, and a margin for a busy machine
        assert not left, [p.pid for p in left]
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait(30)


def test_past_the_restart_limit_the_stage_fails_in_one_line_and_leaves_no_process(tmp_path):
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(max_steps=4, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                     sampling=SamplingConfig(max_new_tokens=8), rewards={"digits": 1.0}, mixed_precision="no",
                     rollout=RolloutConfig(mode="async", max_staleness=1, threads=1, max_restarts=0))
    trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, progress=False,
                          reward_functions={"digits": kill_at_step_1(signal.SIGKILL)})
    with pytest.raises(RolloutError, match=r"^rollout worker 0 \(pid \d+\) died \(SIGKILL\), and 0 workers were "
                                           r"already replaced .* the same command resumes"):
        trainer.train()
    assert rollout_children() == []


def test_a_resumed_run_trains_each_step_once_with_its_versions_restored(tmp_path):
    """Stopped after step 2 of 3 (its checkpoint at step 1), the same run resumes from step 1: the steps in flight
    are sampled again under the checkpoint's version, none is trained twice, and the weights end as an
    uninterrupted run's (max_staleness 0: the same tokens)."""
    whole = run(tmp_path / "whole", rollout=RolloutConfig(mode="async", max_staleness=0, threads=1))
    seen = {}

    def stop_at_2(step, m):
        seen[step] = m
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed", seen={}, checkpoint_every=1,
            rollout=RolloutConfig(mode="async", max_staleness=0, threads=1), on_metrics_hook=stop_at_2)
    assert rollout_children() == []
    resumed_seen = {}
    resumed = run(tmp_path / "resumed", seen=resumed_seen, checkpoint_every=1,
                  rollout=RolloutConfig(mode="async", max_staleness=0, threads=1))
    assert sorted(resumed_seen) == [2, 3]  # step 1 from the checkpoint; steps 2 and 3 trained once each
    assert all(resumed_seen[s]["async/staleness_max"] == 0 for s in (2, 3))
    a, b = weights(whole), weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


# -- the recipe and the stage ------------------------------------------------------------------------------------------

def test_the_recipe_refuses_what_asynchronous_rollouts_cannot_honour():
    from pydantic import ValidationError

    from grpo.configs.recipe import AlignmentGRPOConfig, ReasoningGRPOConfig

    on = {"mode": "async", "max_staleness": 1}
    with pytest.raises(ValidationError, match=r"reasoning_grpo.grpo.rollout.mode async is for GRPO and online RFT: "
                                              r"PPO's value model"):
        ReasoningGRPOConfig(algorithm="ppo", grpo={"rollout": on})
    with pytest.raises(ValidationError, match=r"alignment_grpo.grpo.rollout.mode async with distributed.engine ray: "
                                              r".* set alignment_grpo.grpo.rollout.launcher ray"):
        AlignmentGRPOConfig(grpo={"rollout": on}, distributed={"engine": "ray", "shared_dir": "/srv/r1"})
    AlignmentGRPOConfig(grpo={"rollout": {**on, "launcher": "ray"}},  # Ray Train workers, Ray actors sampling
                        distributed={"engine": "ray", "shared_dir": "/srv/r1"})
    with pytest.raises(ValidationError, match=r"leave devices unset with launcher ray"):
        RolloutConfig(mode="async", launcher="ray", devices=("cuda:1",))
    AlignmentGRPOConfig(grpo={"rollout": on}, distributed={"num_processes": 2})  # each process its own workers
    with pytest.raises(ValidationError, match=r"rollout.sync_every 3 > max_staleness \+ 1 = 2"):
        RolloutConfig(mode="async", max_staleness=1, sync_every=3)
    with pytest.raises(ValidationError, match=r"dynamic_sampling's refills need the scores first"):
        GRPOConfig(dynamic_sampling=True, rollout=on)
    with pytest.raises(ValidationError, match=r"names 1 devices for 2 workers"):
        RolloutConfig(mode="async", workers=2, devices=("cpu",))
    ReasoningGRPOConfig(algorithm="online_rft", grpo={"rollout": on})  # online RFT samples as GRPO does
    for bad in ({"rollout": {"reference": "sampler"}}, {"rollout": {**on, "reference": "sampler"}, "beta": 0.0},
                {"rollout": {**on, "reference": "sampler"}, "lora": {"r": 4}}):
        with pytest.raises(ValidationError, match=r"rollout.reference sampler .* needs rollout.mode async, beta > 0"):
            GRPOConfig(**bad)


def test_a_worker_device_the_machine_lacks_fails_before_any_worker_starts(tmp_path):
    with pytest.raises(ValueError, match=r"grpo.rollout.devices names 'cuda:7'; this machine has cpu and"):
        run(tmp_path, rollout=RolloutConfig(mode="async", devices=("cuda:7",)))
    assert rollout_children() == []


def test_the_reasoning_stage_runs_asynchronously_through_its_flow(prefect_harness, mlflow_client, logged_checkpoint):
    """The stage's task starts and ends the workers; their figures land in the stage's MLflow run."""
    from flows.reasoning_grpo import reasoning_grpo
    from grpo.configs.recipe import ReasoningGRPOConfig
    from tiny_configs import LOGGED_TINY

    config = ReasoningGRPOConfig.model_validate({
        "model": {"tiny": LOGGED_TINY}, "data": {"num_train": 16, "num_heldout": 4},
        "grpo": {"max_steps": 3, "prompts_per_step": 2, "num_generations": 2, "sampling": {"max_new_tokens": 8},
                 "samples_every": 0, "checkpoint_every": 0, "mixed_precision": "no",
                 "rollout": {"mode": "async", "max_staleness": 2, "threads": 1}},
        "eval": {"num_prompts": 4, "num_samples": 0, "max_new_tokens": 8, "num_logged_samples": 2},
        "eval_before": False})
    result = reasoning_grpo(logged_checkpoint, config)
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and run.data.params["grpo.rollout.mode"] == "async"
    staleness = mlflow_client.get_metric_history(result.run_id, "async/staleness_max")
    assert [m.step for m in staleness] == [1, 2, 3] and all(0 <= m.value <= 2 for m in staleness)
    for name in ("async/trainer_idle_s", "async/sampler_busy_s", "async/buffer_depth", "tis/weight_mean",
                 "tis/truncated_share", "tis/mismatch_kl"):
        assert len(mlflow_client.get_metric_history(result.run_id, name)) == 3, name
    assert rollout_children() == []


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_on_two_trainer_processes_max_staleness_0_trains_the_synchronous_weights(tmp_path, strategy):
    """Each process's worker samples its share of the prompts; under fsdp each push gathers the whole weights
    first. The final weights equal the synchronous two-process run's, bit for bit."""
    from transformers import AutoModelForCausalLM

    from processes import HELPERS, launch_two_processes

    launch_two_processes(HELPERS / "ddp_async.py", tmp_path, R1_TEST_STRATEGY=strategy)
    sync, asynchronous = (AutoModelForCausalLM.from_pretrained(tmp_path / run / "model") for run in ("sync", "async"))
    a, b = dict(sync.named_parameters()), dict(asynchronous.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    seen = json.loads((tmp_path / "async" / "metrics-rank0.json").read_text())
    assert sorted(seen, key=int) == ["1", "2", "3"] and all(m["async/staleness_max"] == 0 for m in seen.values())
    if strategy == "fsdp":  # the sampler-copy check ran at each push, on the pushed copy
        assert all(m["sync/logprob_gap"] < 1e-4 for m in seen.values())
