"""The project's MLflow experiment opens on the training runs in MLflow 3's UI, not on its GenAI (traces) view."""

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
