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

from grpo.configs.model import ModelConfig
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


def test_the_non_reasoning_rows_are_logged_as_part_files_and_follow_the_reasoning_rows(
        prefect_harness, answering_checkpoint, prompts_file, mlflow_client, tmp_path):
    """A user file's first rows, read a batch at a time into the run's `dataset/non_reasoning` part files (recorded
    by reference), then appended by the merge after the reasoning rows: the file's rows, in its order."""
    import json

    from flows.rejection_sampling import rejection_sampling
    from runtime.tracking import download
    from tasks.data import read_frame

    rows = [{"prompt": f"Say {i}.", "response": f"{i}!"} for i in range(12)]
    source = tmp_path / "general.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = stage_config(prompts_file, non_reasoning_rows=10, shard_size=16, seed=3)
    raw["data"]["num_train"] = 16
    raw["non_reasoning_source"] = str(source)
    result = rejection_sampling(answering_checkpoint, RejectionSamplingConfig.model_validate(raw))

    dataset = read_frame(result.uris["dataset"])
    reasoning = int(result.metrics["rejection/kept"])
    assert 0 < reasoning and len(dataset) == reasoning + 10 and result.metrics["rejection/non_reasoning_rows"] == 10
    assert dataset["kind"].tolist() == ["reasoning"] * reasoning + ["non_reasoning"] * 10
    tail = dataset.iloc[reasoning:]
    assert tail[["prompt", "response"]].to_dict("records") == rows[:10]
    assert tail["source_prompt_id"].isna().all()  # the reasoning rows' other columns, empty
    logged = [f.path for f in mlflow_client.list_artifacts(result.run_id, "dataset/non_reasoning")]
    assert "dataset/non_reasoning/part-00000.parquet" in logged
    assert read_frame(f"runs:/{result.run_id}/dataset/non_reasoning").to_dict("records") == rows[:10]
    (record,) = [i.dataset for i in mlflow_client.get_run(result.run_id).inputs.dataset_inputs
                 if i.dataset.name == "non_reasoning"]
    assert json.loads(record.profile)["num_rows"] == 10 and str(source) in record.source
    head = json.loads(download(f"runs:/{result.run_id}/samples/non_reasoning_head.json", tmp_path / "h").read_text())
    assert head["data"][0] == ["Say 0.", "0!"]


def test_a_judge_outage_mid_stage_keeps_the_shards_done_and_the_rerun_goes_on_from_them(
        prefect_harness, r1_home, answering_checkpoint, prompts_file, mlflow_client, tmp_path):
    """`r1 serve` as the judge, stopped once the first shard is written: the stage fails naming it, the shards
    written stay, and a rerun against the judge started again elsewhere samples only the others. The run logs the
    judge's calls and the plan it printed first against each shard's measured time."""
    from flows.cli.serve import make_server
    from flows.rejection_sampling import rejection_sampling
    from grpo.rejection.store import read_timing

    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=answering_checkpoint))

    def serve():
        server = make_server(model, tok, port=0, model_name="judge")
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def config(url: str) -> RejectionSamplingConfig:
        raw = stage_config(prompts_file, judge_when="always", shard_size=4, seed=11)
        raw["data"]["num_train"] = 16
        raw["judge"] = {"backend": "http", "base_url": url, "model": "judge", "max_new_tokens": 8,
                        "max_retries": 1, "backoff_s": 0.05}
        return RejectionSamplingConfig.model_validate(raw)

    before = set(shard_files(r1_home))
    first = serve()

    def stop_once_a_shard_is_written():
        deadline = time.monotonic() + 240
        while not set(shard_files(r1_home)) - before and time.monotonic() < deadline:
            time.sleep(0.01)
        first.shutdown()
        first.server_close()

    watcher = threading.Thread(target=stop_once_a_shard_is_written, daemon=True)
    watcher.start()
    with pytest.raises(Exception, match=f"could not reach judge at {first.url}"):
        rejection_sampling(answering_checkpoint, config(first.url))
    watcher.join()
    done = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in set(shard_files(r1_home)) - before}
    assert 0 < len(done) < 4, f"the outage should land midway; {len(done)} of 4 shards were written"

    second = serve()  # the judge back, at another address: the shards are keyed by what it answers, not where
    try:
        result = rejection_sampling(answering_checkpoint, config(second.url))
    finally:
        second.shutdown()
        second.server_close()
    written = set(shard_files(r1_home)) - before
    assert len(written) == 4 and {p.parent for p in written} == {p.parent for p in done}
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in done} == done  # not sampled again
    assert result.metrics["rejection/generated"] == 16 * 4  # every sample counted once
    # the judge's rates and the plan's times are on the stage's run, not among its figures (reruns compare those)
    assert not [k for k in result.metrics if k.startswith(("judge/", "plan/"))]
    m = mlflow_client.get_run(result.run_id).data.metrics

    # the judge's load: every shard's calls (their files keep them), per second of judging and per 1,000 kept rows
    timings = [read_timing(next(iter(done)).parent, i) for i in range(4)]
    assert all(t.judge_calls >= 1 and t.judge_s > 0 for t in timings)
    assert m["judge/calls"] == sum(t.judge_calls for t in timings) >= m["rejection/judge_asked"]
    assert m["judge/calls_per_1k_kept"] == pytest.approx(1000 * m["judge/calls"] / m["rejection/kept"])
    assert m["judge/calls_per_s"] == pytest.approx(m["judge/calls"] / sum(t.judge_s for t in timings))

    # the plan, printed before sampling, against each shard's measured time
    run_id = result.run_id
    budget = mlflow_client.download_artifacts(run_id, "plan/budget.txt", str(tmp_path))
    text = Path(budget).read_text()
    assert "shards               4" in text and "samples              64" in text and "generation time" in text
    assert "tokens/s per generator (measured:" in text
    table = pd.read_json(mlflow_client.download_artifacts(run_id, "plan/shards.json", str(tmp_path)),
                         orient="split")
    assert table["shard"].tolist() == [0, 1, 2, 3] and (table["prompts"] == 4).all()
    assert (table["predicted_s"] > 0).all() and (table["measured_s"] > 0).all()
    assert table["completion_tokens"].tolist() == [t.completion_tokens for t in timings]
    history = mlflow_client.get_metric_history(run_id, "plan/measured_s")
    assert sorted((h.step, h.value) for h in history) == [(i, t.sample_s) for i, t in enumerate(timings)]
    assert m["plan/measured_over_predicted"] == pytest.approx(
        sum(t.sample_s for t in timings) / table["predicted_s"].sum())
