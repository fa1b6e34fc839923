"""The rejection-sampling stage under Prefect: resume after a kill, and the HTTP judge against `r1 serve`'s server."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from grpo.configs.core import ModelConfig
from grpo.configs.recipe import RejectionSamplingConfig
from grpo.models import load_model_and_tokenizer
# on the answering checkpoint's model, reading conftest's `prompts_file` (both fixtures are in tests/conftest.py)
from runs import curated, stage_config

ROOT = Path(__file__).resolve().parents[2]


def shard_files(r1_home: Path) -> list[Path]:
    return sorted((r1_home / "work" / "rejection_sampling").glob("*/shard-*.parquet"))


def test_a_killed_run_resumes_to_exactly_the_uninterrupted_result(prefect_harness, r1_home, answering_checkpoint,
                                                                   prompts_file, tmp_path):
    from flows.rejection_sampling import rejection_sampling

    recipe = tmp_path / "rs.yaml"
    recipe.write_text(yaml.safe_dump({"name": "rs", "rejection_sampling": stage_config(prompts_file)}))
    cfg = RejectionSamplingConfig.model_validate(stage_config(prompts_file))
    shutil.rmtree(r1_home / "work" / "rejection_sampling", ignore_errors=True)

    whole = rejection_sampling(answering_checkpoint, cfg)
    expected = curated(whole.uris["dataset"])
    assert 0 < len(expected) < 48 * 4  # the rule check kept some samples and dropped others
    assert whole.metrics["rejection/generated"] == 48 * 4
    n_shards = len(shard_files(r1_home))
    assert n_shards == 16

    # the same stage in another process, killed once a few shards are written
    shutil.rmtree(r1_home / "work" / "rejection_sampling")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": str(ROOT)}
    log = tmp_path / "stage.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "stage", "rejection_sampling", "--recipe",
                                 str(recipe), "--checkpoint", answering_checkpoint], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not shard_files(r1_home) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the whole group: the flow and the API it started
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    written = len(shard_files(r1_home))
    assert 0 < written < n_shards, (f"the kill should land midway; {written} of {n_shards} shards were written; "
                                    f"the stage's output:\n{log.read_text()[-3000:]}")

    resumed = rejection_sampling(answering_checkpoint, cfg)
    assert resumed.metrics["rejection/generated"] == 48 * 4  # every sample counted once: none lost, none twice
    pd.testing.assert_frame_equal(curated(resumed.uris["dataset"]), expected)


def test_the_judge_over_http_against_the_projects_own_server(prefect_harness, answering_checkpoint, prompts_file,
                                                             mlflow_client):
    from flows.cli.serve import make_server
    from flows.rejection_sampling import rejection_sampling

    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=answering_checkpoint))
    server = make_server(model, tok, port=0, model_name="judge")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        raw = stage_config(prompts_file, judge_when="always", shard_size=16)
        raw["data"]["num_train"] = 16
        raw["judge"] = {"backend": "http", "base_url": server.url, "model": "judge", "max_new_tokens": 16}
        result = rejection_sampling(answering_checkpoint, RejectionSamplingConfig.model_validate(raw))
    finally:
        server.shutdown()
        server.server_close()
    m = result.metrics
    asked = m["rejection/judge_asked"]
    assert asked > 0  # every readable sample went to the judge over HTTP, as well as to the rule check
    assert m["rejection/judge_accepted"] + m["rejection/judge_unparseable"] <= asked
    run = mlflow_client.get_run(result.run_id)
    assert run.data.params["judge.base_url"] == server.url and "rejection/judge_asked" in run.data.metrics


def test_with_the_judge_down_the_stage_fails_naming_the_url_and_writes_no_shard(prefect_harness, r1_home,
                                                                                answering_checkpoint, prompts_file,
                                                                                mlflow_client):
    from flows.rejection_sampling import rejection_sampling

    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    raw = stage_config(prompts_file, judge_when="always", seed=7)
    raw["judge"] = {"backend": "http", "base_url": url, "model": "judge", "max_retries": 1, "backoff_s": 0.05}
    before = set(shard_files(r1_home))
    with pytest.raises(Exception, match=f"could not reach judge at {url}"):
        rejection_sampling(answering_checkpoint, RejectionSamplingConfig.model_validate(raw))
    assert set(shard_files(r1_home)) == before
    failed = mlflow_client.search_runs([e.experiment_id for e in mlflow_client.search_experiments()],
                                       "tags.stage = 'rejection_sampling' and attributes.status = 'FAILED'")
    assert failed


def test_when_nothing_is_kept_the_stage_fails_saying_so_and_keeps_its_counts(prefect_harness, answering_checkpoint,
                                                                             prompts_file, mlflow_client):
    from flows.rejection_sampling import rejection_sampling
    from grpo.data.tables import DataError

    # every response too long: a paragraph of 2 characters or more (an empty one fails its empty answer), whatever
    # the model wrote (an empty think block passes a reasoning limit of 1 character)
    raw = stage_config(prompts_file, max_paragraph_chars=1, max_reasoning_chars=1, shard_size=16, seed=3)
    raw["data"]["num_train"] = 16
    with pytest.raises(DataError, match=r"rejection sampling kept no rows \(kept 0 of 64 samples.*dropped: "):
        rejection_sampling(answering_checkpoint, RejectionSamplingConfig.model_validate(raw))
    failed = mlflow_client.search_runs([e.experiment_id for e in mlflow_client.search_experiments()],
                                       "tags.stage = 'rejection_sampling' and attributes.status = 'FAILED'")
    assert any(r.data.metrics.get("rejection/generated") == 64 and r.data.metrics.get("rejection/kept") == 0
               for r in failed)  # what was dropped, and why, is on the run
