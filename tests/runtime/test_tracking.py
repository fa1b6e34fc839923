"""The project's MLflow experiment is a model-training one, and the UI links `r1` prints name the server to open.

(That the links show the runs in a browser is tests/e2e/test_ui.py's part; MLflow 3.17's UI reads no kind tag.)
"""

import os
import signal

import pandas as pd
import pytest
from mlflow.entities import Metric

from grpo.interrupts import stop_on_signals
from runtime import tracking, ui_links

KIND = "mlflow.experimentKind"


def test_the_experiment_is_created_as_a_model_training_one(mlflow_client, monkeypatch):
    monkeypatch.setenv("R1_EXPERIMENT", "kind-new")
    exp = mlflow_client.get_experiment(tracking.experiment_id())
    assert exp.tags[KIND] == "custom_model_development"  # the UI's "Machine learning" kind: runs, metrics, models


def test_an_older_experiment_gets_the_kind_and_a_chosen_one_is_kept(mlflow_client, monkeypatch):
    old = mlflow_client.create_experiment("kind-old")  # as an earlier version of the project made it
    chosen = mlflow_client.create_experiment("kind-chosen", tags={KIND: "finetuning"})
    monkeypatch.setenv("R1_EXPERIMENT", "kind-old")
    assert tracking.experiment_id() == old
    monkeypatch.setenv("R1_EXPERIMENT", "kind-chosen")
    assert tracking.experiment_id() == chosen
    assert mlflow_client.get_experiment(old).tags[KIND] == "custom_model_development"
    assert mlflow_client.get_experiment(chosen).tags[KIND] == "finetuning"


def test_the_links_point_at_the_tracking_server_or_the_local_mlflow_ui():
    runs = {"a" * 32: "3", "b" * 32: "3"}
    served = ui_links.ui_links(runs, "https://mlflow.team:8443/")
    assert served == {
        "runs": "https://mlflow.team:8443/#/experiments/3/runs?workflowType=machine_learning",
        "a" * 32: f"https://mlflow.team:8443/#/experiments/3/runs/{'a' * 32}?workflowType=machine_learning",
        "b" * 32: f"https://mlflow.team:8443/#/experiments/3/runs/{'b' * 32}?workflowType=machine_learning",
        "compare": f"https://mlflow.team:8443/#/compare-runs?runs=%5B%22{'a' * 32}%22%2C%22{'b' * 32}%22%5D"
                   "&experiments=%5B%223%22%5D&workflowType=machine_learning"}
    local = ui_links.ui_links({"c" * 32: "1"}, "sqlite:////tmp/mlflow.db")
    assert set(local) == {"runs", "c" * 32}  # one run: nothing to compare
    assert all(url.startswith("http://127.0.0.1:5000/#/experiments/1/runs") for url in local.values())
    assert ui_links.ui_command("sqlite:////tmp/mlflow.db").endswith("--port 5000")


def test_ctrl_c_during_a_write_to_the_sqlite_store_lands_after_it_and_the_run_can_still_be_ended(mlflow_client):
    """A stop signal that arrives inside a tracking call waits for the call's end: one stopped inside its SQLite
    transaction left the database locked for the process, so its runs could not be ended KILLED (seen in CI)."""
    run_id = mlflow_client.create_run(tracking.experiment_id()).info.run_id

    def write_after_ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)  # delivered to this (the main) thread at its next instruction
        return mlflow_client.log_batch(run_id, metrics=[Metric("train/loss", 0.5, 0, 1)])

    reached = []
    with pytest.raises(KeyboardInterrupt), stop_on_signals():
        tracking.retry_locked(write_after_ctrl_c)
        reached.append("after the call")  # the interrupt lands as the call ends: not reached
    assert not reached
    assert mlflow_client.get_metric_history(run_id, "train/loss")[0].value == 0.5  # the write went through whole
    tracking.end_run(run_id, "KILLED")  # and the store is not left locked
    assert mlflow_client.get_run(run_id).info.status == "KILLED"


@pytest.mark.parametrize("kind", ["file", "synthetic", "runs", "hub"])
def test_a_dataset_input_names_its_source_and_mlflow_says_nothing(mlflow_client, tmp_path, kind):
    """A file that exists here is a local source; data made in code, a run's output or a hub name is a code source
    tagged with it (not a local path of that name); MLflow's ambiguous-source warning for local paths is not shown."""
    import warnings

    rows = pd.DataFrame({"prompt": ["1 + 1", "2 + 2"], "answer": ["2", "4"]})
    path = tmp_path / "rows.jsonl"
    rows.to_json(path, orient="records", lines=True)
    source = {"file": str(path), "synthetic": "synthetic", "runs": "runs:/abc/dataset/curated",
              "hub": "openai/gsm8k"}[kind]
    run_id = mlflow_client.create_run(tracking.experiment_id()).info.run_id
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # (name, digest) is a dataset's identity in an experiment: one name per kind, or the first kind's is reused
        tracking.log_dataset(run_id, rows, name=f"rows-{kind}", source=source, context="training")
    assert not [w for w in seen if issubclass(w.category, UserWarning)], [str(w.message) for w in seen]
    (inp,) = mlflow_client.get_run(run_id).inputs.dataset_inputs
    assert inp.dataset.source_type == ("local" if kind == "file" else "code")
    assert source in inp.dataset.source


def test_a_long_run_logs_every_table_and_mlflow_lists_those_that_fit(mlflow_client, tmp_path):
    """MLflow lists a run's tables in one tag cut at 8,000 characters, and its own `log_table` failed on the cut list
    from the 150th table on (a GRPO run's sample tables). Every table is written; the tag stays whole."""
    import json

    import mlflow

    run_id = mlflow_client.create_run(tracking.experiment_id()).info.run_id
    for step in range(200):
        tracking.log_table(run_id, pd.DataFrame({"prompt": ["2+2?", "3+3?"], "reward": [1.0, float(step)]}),
                           f"samples/step_{step:05d}.json")
    assert len(mlflow_client.list_artifacts(run_id, "samples")) == 200
    listed = json.loads(mlflow_client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])  # whole, not cut
    assert listed[0] == {"path": "samples/step_00000.json", "type": "table"} and 100 < len(listed) < 200
    # a listed table reads back through MLflow's own reader; an unlisted one is the same format
    table = mlflow_client.load_table(tracking.experiment_id(), "samples/step_00003.json", run_ids=[run_id])
    assert table["reward"].tolist() == [1.0, 3.0]
    last = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="samples/step_00199.json",
                                               dst_path=str(tmp_path))
    assert json.loads(open(last).read()) == {"columns": ["prompt", "reward"], "data": [["2+2?", 1.0], ["3+3?", 199.0]]}
    # the same name again replaces the table, as the sweep's tables are written again when it goes on
    tracking.log_table(run_id, pd.DataFrame({"prompt": ["4+4?"], "reward": [8.0]}), "samples/step_00003.json")
    table = mlflow_client.load_table(tracking.experiment_id(), "samples/step_00003.json", run_ids=[run_id])
    assert table["prompt"].tolist() == ["4+4?"]
