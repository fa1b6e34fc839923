"""`r1 up` / `r1 down` for real: both servers answer, the worker reports, `down` stops exactly what `up` started."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import psutil

from flows.cli import stack
from flows.cli.r1 import main


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status


def test_up_then_down(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("R1_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    bystander = subprocess.Popen(["sleep", "300"])  # a process `down` must leave alone
    try:
        assert main(["up", "--prefect-port", "0", "--mlflow-port", "0"]) == 0
        out = capsys.readouterr().out
        state = json.loads((tmp_path / "stack" / "stack.json").read_text())
        started = [stack.Started(**p) for p in state["processes"]]
        assert [p.name for p in started] == ["prefect-server", "mlflow-server", "worker-r1-process"]
        assert all(stack.is_running(p) for p in started)
        assert state["prefect_ui"] in out and state["mlflow_ui"] in out
        assert f"export PREFECT_API_URL={state['prefect_api']}" in out
        assert f"export MLFLOW_TRACKING_URI={state['mlflow_ui']}" in out

        assert get(state["prefect_api"] + "/health") == 200
        assert get(state["prefect_ui"]) == 200  # the UI
        with urllib.request.urlopen(state["prefect_ui"] + "/ui-settings", timeout=10) as r:
            assert json.load(r)["api_url"] == state["prefect_api"]  # its pages call this server, not :4200
        assert get(state["mlflow_ui"] + "/health") == 200
        assert get(state["mlflow_ui"]) == 200
        assert (tmp_path / "mlflow.db").exists() and (tmp_path / "prefect" / "prefect.db").exists()
        # every deployment is on the server
        with urllib.request.urlopen(urllib.request.Request(
                state["prefect_api"] + "/deployments/filter", data=b"{}", method="POST",
                headers={"Content-Type": "application/json"}), timeout=10) as r:
            names = {d["name"] for d in json.load(r)}
        assert names == {"local", "gpu", "placed", "ray", "r1-process"}  # the pipeline's, and each stage's on r1-process

        assert main(["up", "--prefect-port", "0", "--mlflow-port", "0"]) == 1  # already up: starts nothing more
        assert "already up" in capsys.readouterr().out

        # a recorded PID that now belongs to another program (its start time differs) is not signalled
        state["processes"].append({"name": "reused-pid", "pid": bystander.pid, "started_at": 0.0, "log": ""})
        (tmp_path / "stack" / "stack.json").write_text(json.dumps(state))

        assert main(["down"]) == 0
        out = capsys.readouterr().out
        assert "stopped worker-r1-process" in out and "stopped prefect-server" in out
        for p in started:
            assert not stack.is_running(p), p
            assert not psutil.pid_exists(p.pid) or psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None, "down stopped a process it did not start"
        assert not (tmp_path / "stack" / "stack.json").exists()
        assert main(["down"]) == 0 and "nothing to stop" in capsys.readouterr().out
    finally:
        bystander.kill()
        bystander.wait()
        state_file = tmp_path / "stack" / "stack.json"
        if state_file.exists():  # a failed assertion above: do not leave servers behind
            for p in json.loads(state_file.read_text())["processes"]:
                stack.stop_process(stack.Started(**p))


def test_up_with_a_taken_port_starts_nothing(tmp_path, monkeypatch, capsys):
    import socket

    monkeypatch.setenv("R1_HOME", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--prefect-port", str(port), "--mlflow-port", "0"]) == 2  # a user error, said once
    err = capsys.readouterr().err
    assert f"--prefect-port {port}: cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert not (tmp_path / "stack" / "stack.json").exists()
