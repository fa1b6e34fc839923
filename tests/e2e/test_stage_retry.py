"""A stage retried in process (flows/attempts.py): after a transient failure the next attempt is a new stage run
that resumes from the last durable checkpoint, and an attempt that runs past its `timeout_s` is stopped.

Each test runs a real `r1 run` on a home of its own (the tiny model, MLflow on SQLite, its own local Prefect API);
the failures are real: the disk under the work folders fills up (a tmpfs, where the test may mount one), and an
attempt outlives its time limit.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from disks import fill, mount_tmpfs
from tiny_configs import TINY_STAGE


def cold_start(tmp_path: Path, resources: dict, max_steps: int) -> list[str]:
    cold = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0}, "resources": resources,
            "train": {**TINY_STAGE["train"], "max_steps": max_steps, "checkpoint_every": 4, "mixed_precision": "no"}}
    recipe = tmp_path / "retry.yaml"
    recipe.write_text(yaml.safe_dump({"name": "retry", "cold_start_sft": cold}))
    return ["run", "--recipe", str(recipe), "--stages", "cold_start_sft"]


def stage_runs(run) -> list:
    """The stage's MLflow runs, oldest first."""
    return sorted((r for r in run.runs() if r.data.tags.get("stage") == "cold_start_sft"),
                  key=lambda r: r.info.start_time)


def test_a_stage_that_fails_on_a_full_disk_is_retried_and_resumes_once_there_is_room(r1, tmp_path, monkeypatch):
    from grpo.training.checkpoints import resumable_step

    work = tmp_path / "home" / "work"
    if not mount_tmpfs(work, "160m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        # 240 steps with a pause after every second one (12 s of pauses at least): still training when the test has
        # seen a checkpoint and filled the disk (80 and then 240 steps flat out ended before the disk was full), and
        # no core spent on steps the test does not need
        monkeypatch.setenv("R1_STEP_PAUSE_S", "0.1")
        run = r1(*cold_start(tmp_path, {"retries": 1, "retry_delays_s": [8], "timeout_s": 600}, max_steps=240))
        # the first checkpoint, seen on the disk itself (polling MLflow for the work folder first took long enough
        # on a busy machine for all 600 steps to end before the disk was filled)
        checkpoint = run.wait_for("a checkpoint", lambda: next(
            (p for p in work.rglob("step-*") if p.parent.name == "checkpoints" and resumable_step(p.parent.parent)),
            None))
        folder = checkpoint.parent.parent
        filler = fill(work, leave=64 * 1024)
        run.wait_for("the first attempt to fail", lambda: (rs := stage_runs(run)) and rs[0].info.status == "FAILED")
        step = resumable_step(Path(folder))
        filler.unlink()  # room again, within the pause before the next attempt

        assert run.proc.wait(300) == 0, run.output()[-3000:]
        out = run.output()
        retried = [line for line in out.splitlines() if "attempt 1 of 2 failed" in line]
        assert len(retried) == 1 and "Fault: the disk under" in retried[0], out[-3000:]
        first, second = stage_runs(run)
        assert (first.info.status, second.info.status) == ("FAILED", "FINISHED")
        assert int(second.data.tags["r1.resumed_from_step"]) == step >= 4
        assert {r.info.status for r in run.runs() if "stage" not in r.data.tags} == {"FINISHED"}
    finally:
        import subprocess

        subprocess.run(["umount", "-l", str(work)], check=False)


def test_an_attempt_past_its_timeout_is_stopped_and_the_next_resumes_from_its_checkpoint(r1, tmp_path, monkeypatch):
    limit = 15
    monkeypatch.setenv("R1_STEP_PAUSE_S", "0.2")  # each attempt trains until stopped: slowly, a core left to the rest
    run = r1(*cold_start(tmp_path, {"retries": 1, "retry_delays_s": [0], "timeout_s": limit}, max_steps=100_000))
    started = time.monotonic()
    assert run.proc.wait(6 * limit + 120) == 1, run.output()[-3000:]
    took = time.monotonic() - started
    first, second = stage_runs(run)  # two attempts, each a stage run of its own
    assert (first.info.status, second.info.status) == ("FAILED", "FAILED")
    for attempt in (first, second):  # each stopped at its limit (plus the time to end its run)
        assert attempt.info.end_time - attempt.info.start_time < (limit + 30) * 1000
    assert int(second.data.tags["r1.resumed_from_step"]) >= 4  # the second went on from the first's checkpoint
    assert took < 2 * (limit + 30) + 90  # neither ran on past its limit (start-up of r1 included)
    out = run.output()
    assert "attempt 1 of 2 failed (FlowRunTimeoutError" in out
    assert [line for line in out.splitlines() if line.startswith("r1:")] == [
        "r1: cold_start_sft: every attempt ran past its time limit (cold_start_sft.resources.timeout_s = 15 s); the "
        "same command resumes from its last durable checkpoint"], out[-3000:]
    # the advice, followed: the same command again starts from where the second attempt stopped, not from step 0
    again = r1(*cold_start(tmp_path, {"retries": 1, "retry_delays_s": [0], "timeout_s": limit}, max_steps=100_000))
    third = again.wait_for("the third attempt, resumed", lambda: next(
        (r for r in stage_runs(again)[2:] if "r1.resumed_from_step" in r.data.tags), None), timeout=180)
    again.kill()
    assert int(third.data.tags["r1.resumed_from_step"]) > int(second.data.tags["r1.resumed_from_step"])
