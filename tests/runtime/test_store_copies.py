"""New MLflow stores made from a migrated copy (runtime.store_copies): the copy holds the tables and no experiment, a
new store made from it is MLflow's own (its Default experiment where that store puts artifacts, runs and models
written and read back), a database that exists is never touched, and the switch turns it off."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mlflow import MlflowClient

from runtime import store_copies


def _count(db: Path, table: str) -> int:
    with sqlite3.connect(db) as con:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_a_new_mlflow_store_starts_from_the_migrated_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("R1_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "home" / "mlflow.db"
    assert store_copies.seed_mlflow(db)
    [template] = (tmp_path / "cache").glob("mlflow-*.db")
    assert _count(template, "alembic_version") == 1 and _count(template, "experiments") == 0
    assert not [p for p in (tmp_path / "cache").iterdir() if p != template]  # no scratch left

    client = MlflowClient(f"sqlite:///{db}")
    default = client.get_experiment("0")  # made by the store that opened the copy, with its own artifact folder
    assert default.name == "Default" and "/cache/" not in default.artifact_location
    exp = client.create_experiment("seeded", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(exp).info.run_id
    client.log_metric(run, "m", 1.5, step=3)
    client.create_registered_model("r1-seeded")
    client.set_terminated(run)
    assert client.get_run(run).data.metrics == {"m": 1.5} and client.get_registered_model("r1-seeded")
    assert _count(template, "runs") == 0 and _count(template, "experiments") == 0  # the copy stays empty

    assert not store_copies.seed_mlflow(db)  # a store that exists keeps what it holds
    assert _count(db, "runs") == 1
    other = tmp_path / "other" / "mlflow.db"
    monkeypatch.setenv("R1_STORE_CACHE", "0")
    assert not store_copies.seed_mlflow(other) and not other.exists()


def test_a_cache_that_cannot_be_written_costs_only_the_migrations(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("R1_CACHE", str(blocked / "cache"))  # under a file: no folder can be made
    db = tmp_path / "home" / "mlflow.db"
    assert not store_copies.seed_mlflow(db) and not db.exists()
    assert MlflowClient(f"sqlite:///{db}").get_experiment("0").name == "Default"  # MLflow migrates, as before
