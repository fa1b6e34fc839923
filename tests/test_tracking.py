"""The project's MLflow experiment is a model-training one, and the UI links `r1` prints name the server to open.

(That the links show the runs in a browser is tests/test_ui.py's part; MLflow 3.17's UI reads no kind tag.)
"""

from tasks import tracking

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
    served = tracking.ui_links(runs, "https://mlflow.team:8443/")
    assert served == {
        "runs": "https://mlflow.team:8443/#/experiments/3/runs?workflowType=machine_learning",
        "a" * 32: f"https://mlflow.team:8443/#/experiments/3/runs/{'a' * 32}?workflowType=machine_learning",
        "b" * 32: f"https://mlflow.team:8443/#/experiments/3/runs/{'b' * 32}?workflowType=machine_learning",
        "compare": f"https://mlflow.team:8443/#/compare-runs?runs=%5B%22{'a' * 32}%22%2C%22{'b' * 32}%22%5D"
                   "&experiments=%5B%223%22%5D&workflowType=machine_learning"}
    local = tracking.ui_links({"c" * 32: "1"}, "sqlite:////tmp/mlflow.db")
    assert set(local) == {"runs", "c" * 32}  # one run: nothing to compare
    assert all(url.startswith("http://127.0.0.1:5000/#/experiments/1/runs") for url in local.values())
    assert tracking.ui_command("sqlite:////tmp/mlflow.db").endswith("--port 5000")
