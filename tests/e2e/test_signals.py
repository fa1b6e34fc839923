"""Ctrl-C and SIGTERM stop a run within seconds, in whatever stage it is, and the next run carries on.

Each test starts a real `r1` in a session of its own, as a terminal or a job scheduler starts it, on an embedded home
of its own with no Prefect server configured, so it starts its own local Prefect API, as a user's first run does.
The signal goes to the whole process group (a terminal's Ctrl-C, `timeout`) or to the `r1` process alone (`kill`).
After it: `r1` exits 130 within 30 s with one line and no traceback, every process it started has ended, its MLflow
runs are KILLED, its Prefect flow runs Crashed (read from the local API's own database), and the same command resumes.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml

from answering import SMALL
from processes import R1, STOP_WITHIN_S
from runs import stage_run
from tiny_configs import DISTRIBUTED_STAGE, TINY_STAGE


def assert_stopped_cleanly(run: R1, took: float, family: list[psutil.Process], runs: list[str]) -> None:
    """... and `runs` (stage names; "pipeline" for a pipeline's parent run) are the MLflow runs it made."""
    out = run.output()
    assert run.proc.returncode == 130, out[-3000:]
    assert took < STOP_WITHIN_S, f"r1 took {took:.1f} s to exit"
    assert "Traceback" not in out and "Error logging to API" not in out, out[-3000:]
    assert [line for line in out.splitlines() if line.startswith("r1:")] == [
        next(line for line in out.splitlines() if line.startswith("r1: interrupted"))]
    _, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, f"still running after r1 exited: {[p.cmdline() for p in alive]}"
    status = {r.data.tags.get("stage", "pipeline"): r.info.status for r in run.runs()}
    assert set(status) == set(runs) and set(status.values()) == {"KILLED"}, status
    states = run.flow_run_states()
    assert states and set(states) <= {"CRASHED", "CANCELLED"}, states


def test_ctrl_c_in_a_terminal_during_training_stops_it_and_the_next_run_resumes(r1, tmp_path):
    from grpo.training.checkpoints import resumable_step

    # fp32: the stop is the point. 40 steps: the stop lands within a second of the first checkpoint (step 5), 35
    # steps (10 s or more on any CPU) from the end, and the resumed run has only those to train
    cold = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0},
            "train": {**TINY_STAGE["train"], "max_steps": 40, "checkpoint_every": 5, "mixed_precision": "no"}}
    recipe = tmp_path / "train.yaml"
    recipe.write_text(yaml.safe_dump({"name": "signals", "cold_start_sft": cold}))
    args = ["run", "--recipe", str(recipe), "--stages", "cold_start_sft"]
    run = r1(*args)
    work = run.wait_for("cold-start training", lambda: (r := stage_run(run, "cold_start_sft")) and
                        r.data.tags.get("r1.work_dir.cold_start_sft"))
    run.wait_for("a checkpoint", lambda: resumable_step(Path(work)))
    took, family = run.stop(signal.SIGINT, whole_group=True)
    assert_stopped_cleanly(run, took, family, ["pipeline", "cold_start_sft"])
    step = resumable_step(Path(work))

    again = r1(*args)
    assert again.proc.wait(600) == 0, again.output()[-3000:]  # a few minutes of steps on a busy 2-core machine
    resumed = next(r for r in again.runs() if r.data.tags.get("stage") == "cold_start_sft"
                   and r.info.status == "FINISHED")
    assert int(resumed.data.tags["r1.resumed_from_step"]) == step >= 5


def test_ctrl_c_during_rejection_sampling_stops_its_shards_and_the_next_run_skips_the_written_ones(
        r1, tmp_path, answering_checkpoint):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "Problem {i}: what is it?", "answer": "1"}}\n' for i in range(96)))
    stage = {"model": {"tiny": SMALL.model_dump()}, "data": {"source": str(prompts), "num_train": 96, "num_heldout": 0},
             "rejection": {"samples_per_prompt": 4, "sampling": {"max_new_tokens": 64}, "target_samples": 200,
                           "shard_size": 4, "decontamination_ngram": 0, "non_reasoning_rows": 0}}
    recipe = tmp_path / "rs.yaml"
    recipe.write_text(yaml.safe_dump({"name": "signals-rs", "rejection_sampling": stage}))
    args = ["stage", "rejection_sampling", "--recipe", str(recipe), "--checkpoint", answering_checkpoint]
    run = r1(*args)
    shards = run.home / "work" / "rejection_sampling"
    run.wait_for("a written shard", lambda: list(shards.glob("*/shard-*.parquet")))
    took, family = run.stop(signal.SIGINT, whole_group=True)
    written = sorted(p.name for p in shards.glob("*/shard-*.parquet"))
    assert 0 < len(written) < 24
    assert_stopped_cleanly(run, took, family, ["rejection_sampling"])

    again = r1(*args)
    assert again.proc.wait(300) == 0, again.output()[-3000:]
    assert f"({len(written)} already written in" in again.output()
    assert len(list(shards.glob("*/shard-*.parquet"))) == 24


def test_sigterm_to_r1_alone_stops_a_loop_launched_on_two_processes(r1, tmp_path):
    stage = {**DISTRIBUTED_STAGE, "train": {**DISTRIBUTED_STAGE["train"], "max_steps": 100000}}
    recipe = tmp_path / "ddp.yaml"
    recipe.write_text(yaml.safe_dump({"name": "signals-ddp", "cold_start_sft": stage}))
    run = r1("stage", "cold_start_sft", "--recipe", str(recipe))

    def training_on_two_processes() -> bool:  # the launcher and its two workers, each past its first step
        work = (r := stage_run(run, "cold_start_sft")) and r.data.tags.get("r1.work_dir.cold_start_sft")
        events = Path(work) / "launch" / "events.jsonl" if work else None
        return bool(events and events.exists() and events.stat().st_size)

    run.wait_for("training on two processes", training_on_two_processes)
    # the launcher (accelerate's, then torch's elastic agent) and the two training processes name the worker module
    workers = [p for p in psutil.Process(run.proc.pid).children(recursive=True) if "grpo.training.launchers.worker" in p.cmdline()]
    assert len(workers) >= 3, [p.cmdline() for p in psutil.Process(run.proc.pid).children(recursive=True)]
    took, family = run.stop(signal.SIGTERM, whole_group=False)  # `kill <pid>`: nothing else gets the signal
    assert_stopped_cleanly(run, took, family, ["cold_start_sft"])
    assert all(w in family for w in workers)


# Prefect's flow-run time limit raises from a SIGALRM handler, and inside a flow run its SIGTERM handler raises
# TerminationSignal: one raised inside a SQLite commit left every later write of the process "database is locked" (an
# attempt past its limit under load, tests/e2e/test_stage_retry.py; a sweep's point stopped by its sweep mid-write,
# its runs left RUNNING)
@pytest.mark.parametrize("sig", [signal.SIGALRM, signal.SIGTERM], ids=["time limit", "sigterm"])
def test_a_handler_someone_set_waits_for_the_store_call_then_raises(sig):
    from grpo.interrupts import signals_deferred

    class Raised(Exception):
        pass

    def theirs(signum, frame):
        raise Raised

    previous = signal.signal(sig, theirs)
    finished = []
    try:
        with pytest.raises(Raised):
            with signals_deferred():
                if sig == signal.SIGALRM:
                    signal.setitimer(signal.ITIMER_REAL, 0.01)
                else:
                    os.kill(os.getpid(), sig)
                time.sleep(0.2)  # it arrives here, and waits
                finished.append(True)
        assert finished == [True]
        assert signal.getsignal(sig) is theirs  # the handler is back in place
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(sig, previous)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost stop, printed by Python
def test_a_stop_that_lands_in_a_finalizer_is_raised_again_at_the_next_training_step():
    """A signal handler runs wherever the main thread is: inside a `__del__` its KeyboardInterrupt is only printed
    (a sweep's point stopped as a collected socket closed trained on until killed). `raise_if_stopping`, called at
    each training callback (runtime/progress.py), raises it there."""
    from grpo.interrupts import raise_if_stopping, stop_on_signals

    class Closing:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs in here, at the next instruction
            time.sleep(0.01)

    with stop_on_signals():
        raise_if_stopping()  # no stop: nothing raised
        Closing()  # collected at once; its finalizer gets the stop, and Python goes on past it
        reached = True
        with pytest.raises(KeyboardInterrupt):
            raise_if_stopping()
    assert reached
    raise_if_stopping()  # the stop belonged to that block only


def test_sigterm_to_r1_alone_stops_an_asynchronous_stage_and_its_sampler_processes(r1, tmp_path, answering_checkpoint):
    # a cancel from the Prefect UI or `kill <pid>`: the sampler processes get no signal of their own, and must end too
    stage = {"model": {"tiny": SMALL.model_dump()}, "data": {"num_train": 16, "num_heldout": 4},
             "grpo": {"max_steps": 100000, "prompts_per_step": 2, "num_generations": 2, "samples_every": 0,
                      "checkpoint_every": 0, "mixed_precision": "no", "sampling": {"max_new_tokens": 8},
                      "rollout": {"mode": "async", "max_staleness": 1, "threads": 1}},
             "eval_before": False}
    recipe = tmp_path / "async.yaml"
    recipe.write_text(yaml.safe_dump({"name": "signals-async", "reasoning_grpo": stage}))
    run = r1("stage", "reasoning_grpo", "--recipe", str(recipe), "--checkpoint", answering_checkpoint)

    def samplers() -> list[psutil.Process]:
        try:
            family = psutil.Process(run.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        # the sampler processes and the fork server they came from (multiprocessing's start, either way)
        return [p for p in family if any(m in " ".join(p.cmdline()) for m in ("multiprocessing.spawn", "forkserver"))]

    run.wait_for("a training step", lambda: (r := stage_run(run, "reasoning_grpo")) and
                 run.mlflow.get_metric_history(r.info.run_id, "async/staleness_max"))
    workers = samplers()
    assert workers, [p.cmdline() for p in psutil.Process(run.proc.pid).children(recursive=True)]
    took, family = run.stop(signal.SIGTERM, whole_group=False)
    assert_stopped_cleanly(run, took, family, ["reasoning_grpo"])
    assert all(w in family for w in workers)
