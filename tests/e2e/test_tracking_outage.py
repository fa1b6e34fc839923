"""A tracking server that goes away mid-stage does not stop training: a real `mlflow server` on 127.0.0.1 is killed
while `r1 run` trains, then started again on the same port and database. Training goes on meanwhile, one line says
the server is not answering and how long a run waits for it, no urllib3 retry warning shows, and once it is back
the stage finishes with every metric written once and no run left RUNNING."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from mlflow import MlflowClient

from tiny_configs import TINY_STAGE

ROOT = Path(__file__).resolve().parents[2]
STEPS, LOG_EVERY = 60, 2


def wait_for(what: str, check, proc: subprocess.Popen, log: Path, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"r1 ended ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout} s:\n{log.read_text()[-3000:]}")


def stage_runs(client: MlflowClient) -> list:
    try:
        return client.search_runs([e.experiment_id for e in client.search_experiments()])
    except Exception:  # noqa: BLE001 (the server is starting, or away)
        return []


def test_a_tracking_server_killed_mid_stage_and_started_again(tmp_path):
    from flows.cli import stack
    from grpo.training.checkpoints import resumable_step

    port = stack.free_port()
    db, artifacts, logs = tmp_path / "mlflow.db", tmp_path / "mlartifacts", tmp_path / "logs"
    server, uri = stack.start_mlflow_server(db, artifacts, port, logs)
    client = MlflowClient(tracking_uri=uri)
    cold = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0},
            "train": {**TINY_STAGE["train"], "max_steps": STEPS, "log_every": LOG_EVERY, "checkpoint_every": 4,
                      "mixed_precision": "no"}}
    recipe = tmp_path / "outage.yaml"
    recipe.write_text(yaml.safe_dump({"name": "outage", "cold_start_sft": cold}))
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
    env.update(R1_HOME=str(tmp_path / "home"), MLFLOW_TRACKING_URI=uri, PYTHONPATH=str(ROOT),
               R1_TRACKING_WAIT_S="120", R1_SYSTEM_METRICS="0")
    log = tmp_path / "r1.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--recipe", str(recipe), "--stages",
                                 "cold_start_sft"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        def stage():
            return next((r for r in stage_runs(client) if r.data.tags.get("stage") == "cold_start_sft"), None)

        run = wait_for("cold-start training", lambda: (r := stage()) and "train/loss" in r.data.metrics and r,
                       proc, log)
        folder = Path(run.data.tags["r1.work_dir.cold_start_sft"])
        os.killpg(server.pid, signal.SIGKILL)  # the server and its workers, at once
        os.waitpid(server.pid, 0)
        down_at = resumable_step(folder)
        # training goes on without it: two more checkpoints written while it is away
        wait_for("training while the server is away", lambda: resumable_step(folder) >= down_at + 8, proc, log)
        # the line comes from the writer's thread when its next write finds the server away: on a fast CPU the
        # checkpoints above can come first (60 steps at ~40 a second), so it is waited for, not expected already
        wait_for("the line saying the server is not answering", lambda: "is not answering" in log.read_text(),
                 proc, log)
        server, _ = stack.start_mlflow_server(db, artifacts, port, logs)  # the same port and database

        assert proc.wait(300) == 0, log.read_text()[-3000:]
        out = log.read_text()
        lines = [line for line in out.splitlines() if "is not answering" in line]
        assert len(lines) == 1 and f"the MLflow server at {uri} is not answering" in lines[0], out[-3000:]
        assert "waits up to 120 s" in lines[0] and "Retrying (" not in out and "Traceback" not in out, out[-3000:]

        runs = stage_runs(client)
        assert {r.data.tags.get("stage", "pipeline"): r.info.status for r in runs} == {
            "pipeline": "FINISHED", "cold_start_sft": "FINISHED"}
        sft = next(r for r in runs if r.data.tags.get("stage") == "cold_start_sft")
        for key in ("train/loss", "train/learning_rate"):
            steps = [m.step for m in client.get_metric_history(sft.info.run_id, key)]
            assert sorted(steps) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), (key, steps)  # each once
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        stack.stop_process(server)


def test_a_tracking_server_away_past_the_wait_is_one_line_and_its_advice_works(tmp_path):
    """The server stays away longer than a run waits for it (R1_TRACKING_WAIT_S): the stage ends with the one Fault
    line, whose advice, followed as written (the server started again, the same command run again), resumes the
    stage from the checkpoints it kept and finishes it."""
    from flows.cli import stack
    from grpo.training.checkpoints import resumable_step

    port = stack.free_port()
    db, artifacts, logs = tmp_path / "mlflow.db", tmp_path / "mlartifacts", tmp_path / "logs"
    server, uri = stack.start_mlflow_server(db, artifacts, port, logs)
    client = MlflowClient(tracking_uri=uri)
    cold = {**TINY_STAGE, "data": {"num_train": 64, "num_heldout": 0},
            "train": {**TINY_STAGE["train"], "max_steps": STEPS, "log_every": LOG_EVERY, "checkpoint_every": 4,
                      "mixed_precision": "no"}}
    recipe = tmp_path / "away.yaml"
    recipe.write_text(yaml.safe_dump({"name": "away", "cold_start_sft": cold}))
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
    env.update(R1_HOME=str(tmp_path / "home"), MLFLOW_TRACKING_URI=uri, PYTHONPATH=str(ROOT),
               R1_TRACKING_WAIT_S="5", R1_SYSTEM_METRICS="0")
    command = [sys.executable, "-m", "flows.cli", "run", "--recipe", str(recipe), "--stages", "cold_start_sft"]

    def run(log: Path) -> subprocess.Popen:
        with open(log, "wb") as out:
            return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    first = run(tmp_path / "first.log")
    try:
        def stage():
            return next((r for r in stage_runs(client) if r.data.tags.get("stage") == "cold_start_sft"), None)

        started = wait_for("cold-start training", lambda: (r := stage()) and "train/loss" in r.data.metrics and r,
                           first, tmp_path / "first.log")
        folder = Path(started.data.tags["r1.work_dir.cold_start_sft"])
        os.killpg(server.pid, signal.SIGKILL)  # and it stays away
        os.waitpid(server.pid, 0)
        assert first.wait(300) == 1
        out = (tmp_path / "first.log").read_text()
        faults = [line for line in out.splitlines() if line.startswith("r1:")]
        assert len(faults) == 1 and "Traceback" not in out, out[-3000:]
        assert f"the MLflow server at {uri} did not answer for 5 s (R1_TRACKING_WAIT_S)" in faults[0]
        assert "run the same command again once the server answers to resume" in faults[0]
        kept = resumable_step(folder)
        assert kept >= 4  # the stage's local checkpoints are kept, as the line says

        server, _ = stack.start_mlflow_server(db, artifacts, port, logs)  # the server answers again
        second = run(tmp_path / "second.log")  # the same command
        assert second.wait(300) == 0, (tmp_path / "second.log").read_text()[-3000:]
        runs = {r.info.run_id: r for r in stage_runs(client) if r.data.tags.get("stage") == "cold_start_sft"}
        assert runs[started.info.run_id].info.status == "FAILED"  # the first process's run, marked at this start
        [resumed] = [r for r in runs.values() if r.info.status == "FINISHED"]
        assert int(resumed.data.tags["r1.resumed_from_step"]) >= kept  # from the checkpoints the first one kept
    finally:
        for proc in (p for p in (locals().get("first"), locals().get("second")) if p is not None):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        stack.stop_process(server)
