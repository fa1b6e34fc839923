"""Every stage run records system metrics (`system/...`) against its own run id, on the embedded SQLite store too,
and a stage that fails still has them."""

import time

import pytest
from pydantic import BaseModel

from runtime import system_metrics
from runtime.stage import stage_run

FIGURES = ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
           "system/disk_usage_percentage", "system/network_receive_megabytes")


class Settings(BaseModel):
    steps: int = 1


def test_a_stage_run_records_system_metrics_sampled_while_it_ran(mlflow_client, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    with stage_run("system_metrics_check", Settings(), None) as run_id:
        time.sleep(0.7)  # three intervals, and the figures at the end
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for name in FIGURES:
        assert name in run.data.metrics, name
    history = mlflow_client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert [m.step for m in history] == list(range(len(history))) and len(history) >= 3
    assert [m.timestamp for m in history] == sorted(m.timestamp for m in history)
    assert 0 < run.data.metrics["system/system_memory_usage_megabytes"]


def test_a_failed_stage_keeps_its_system_metrics(mlflow_client):
    with pytest.raises(RuntimeError):
        with stage_run("system_metrics_check", Settings(), None) as run_id:
            raise RuntimeError("the stage broke")
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FAILED" and "system/cpu_utilization_percentage" in run.data.metrics


def test_system_metrics_can_be_turned_off(mlflow_client, monkeypatch):
    monkeypatch.setenv("R1_SYSTEM_METRICS", "0")
    assert system_metrics.start("any run") is None
    with stage_run("system_metrics_check", Settings(), None) as run_id:
        pass
    assert not [k for k in mlflow_client.get_run(run_id).data.metrics if k.startswith("system/")]
