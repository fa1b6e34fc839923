"""The judge's API key never leaks: not into MLflow, not into Prefect (parameters, logs, artifacts), not to the console.

A rejection-sampling stage runs as `r1 stage rejection_sampling` in its own process (so every byte it writes to
stdout and stderr is captured), against this session's Prefect test API and MLflow store, with an HTTP judge: the
project's own server, which refuses any request without the key. The key is only in the environment variable the
judge config names, and the stage must have used it (the judge was asked). Logging runs at DEBUG, so a library
that logs request headers would show up here too.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import yaml

from grpo.configs.model import ModelConfig
from grpo.models import load_model_and_tokenizer
from runs import stage_config  # the fixtures (prompts_file, answering_checkpoint): conftest

ROOT = Path(__file__).resolve().parents[2]
KEY_ENV = "R1_TEST_JUDGE_KEY"


async def _prefect_record(flow_run_id: str) -> tuple[dict, list[str], list[str]]:
    """A flow run's parameters, the messages of every log it (and its tasks) sent, and its artifacts' data."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        flow_run = await client.read_flow_run(uuid.UUID(flow_run_id))
        logs = await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])))
        artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
    return flow_run.parameters, [log.message for log in logs], [str(a.data) for a in artifacts]


def test_the_judge_key_appears_nowhere(prefect_harness, answering_checkpoint, prompts_file,
                                       mlflow_client, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from flows.cli.serve import make_server

    key = "sk-r1-" + uuid.uuid4().hex  # unique, so any occurrence anywhere is this test's key
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=answering_checkpoint))
    server = make_server(model, tok, port=0, model_name="judge", api_key=key)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    raw = stage_config(prompts_file, judge_when="always", shard_size=8, seed=11)
    raw["data"]["num_train"] = 8
    raw["judge"] = {"backend": "http", "base_url": server.url, "model": "judge", "max_new_tokens": 8,
                    "api_key_env": KEY_ENV}
    recipe = tmp_path / "secret.yaml"
    recipe.write_text(yaml.safe_dump({"name": "secret", "rejection_sampling": raw}))
    env = {**os.environ, KEY_ENV: key, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT),
           "PREFECT_LOGGING_LEVEL": "DEBUG", "PREFECT_LOGGING_ROOT_LEVEL": "DEBUG",
           "PREFECT_LOGGING_LOG_PRINTS": "true", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "stage", "rejection_sampling", "--recipe",
                               str(recipe), "--checkpoint", answering_checkpoint], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        server.shutdown()
        server.server_close()
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]

    experiments = [e.experiment_id for e in mlflow_client.search_experiments()]
    [run] = mlflow_client.search_runs(experiments, f"params.`judge.api_key_env` = '{KEY_ENV}'")
    assert run.data.metrics["rejection/judge_asked"] > 0, "the judge was never asked, so the key was never used"
    assert run.data.params["judge.api_key_env"] == KEY_ENV  # the variable's name is logged, its value is not
    flow_run_id = run.data.tags["prefect.flow_run_id"]
    parameters, logs, artifacts = asyncio.run(_prefect_record(flow_run_id))
    assert logs, "no Prefect logs were read back: the check below would prove nothing"
    assert any("shard" in m for m in logs)

    places = {"console": console, "Prefect flow run parameters": repr(parameters),
              "Prefect logs": "\n".join(logs), "Prefect artifacts": "\n".join(artifacts)}
    for r in mlflow_client.search_runs(experiments):  # every run of every experiment, not only this one
        places[f"MLflow run {r.info.run_id} params"] = repr(r.data.params)
        places[f"MLflow run {r.info.run_id} tags"] = repr(r.data.tags)
    leaks = [where for where, text in places.items() if key in text]
    assert not leaks, f"the judge's API key leaked into: {leaks}"
    # and it was the key that let the stage in: the server refuses requests without it
    assert "HTTP 401" not in console
