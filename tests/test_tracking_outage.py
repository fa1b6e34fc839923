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

from test_flows import TINY_STAGE

ROOT = Path(__file__).resolve().parents[1]
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
