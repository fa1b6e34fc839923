"""The catalogue of mistakes a user can make (continued from test_errors.py): endpoints, ports and folders, each told
by the real `r1` command in one line before anything starts, with the same checks and the same workspace."""

from __future__ import annotations

import socket

from cli_workspace import closed_port, fails_cleanly  # the `ws` fixture: tests/flows/cli/conftest.py


# ----------------------------------------------------------------------------------------------------------------
# Endpoints, ports and folders


def test_an_mlflow_server_that_does_not_answer(ws, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "cold_start_sft"],
                  "MLFLOW_TRACKING_URI=http://127.0.0.1:", "no MLflow server answers")


def test_a_tracking_uri_of_an_unknown_kind(ws, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "ftp://example/mlflow")
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "cold_start_sft"],
                  "MLFLOW_TRACKING_URI=ftp://example/mlflow", "expected an http(s):// server")


def test_a_prefect_server_that_does_not_answer(ws, capsys, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{closed_port()}/api")
    fails_cleanly(capsys, ws, ["run", "--recipe", ws.recipe(), "--stages", "cold_start_sft"],
                  "PREFECT_API_URL=http://127.0.0.1:", "no Prefect server answers")


def test_a_judge_endpoint_that_does_not_answer(ws, capsys):
    judge = {"backend": "http", "base_url": f"http://127.0.0.1:{closed_port()}/v1", "model": "judge"}
    recipe = ws.recipe(rejection_sampling__judge=judge)
    fails_cleanly(capsys, ws, ["stage", "rejection_sampling", "--recipe", recipe, "--checkpoint", str(ws.root)],
                  "rejection_sampling.judge:")


def test_a_state_folder_that_is_a_file(ws, capsys, monkeypatch):
    monkeypatch.setenv("R1_HOME", ws.file("home-file", ""))
    fails_cleanly(capsys, ws, ["where"], "home-file is a file", "expected a folder")


def test_serve_on_a_port_out_of_range(ws, capsys):
    fails_cleanly(capsys, ws, ["serve", "tiny", "--port", "70000"], "--port must be in 0..65535", "70000")


def test_serve_a_checkpoint_folder_that_is_not_there(ws, capsys):
    fails_cleanly(capsys, ws, ["serve", str(ws.root / "no-ckpt"), "--port", "0"], "no-ckpt: no such file or folder")


def test_serve_with_a_key_variable_that_is_not_set(ws, capsys, monkeypatch):
    monkeypatch.delenv("R1_TEST_UNSET_KEY", raising=False)
    fails_cleanly(capsys, ws, ["serve", "tiny", "--api-key-env", "R1_TEST_UNSET_KEY"], "$R1_TEST_UNSET_KEY")


def test_up_on_a_port_out_of_range(ws, capsys):
    fails_cleanly(capsys, ws, ["up", "--prefect-port", "70000"], "--prefect-port must be in 0..65535")


def test_up_on_a_port_in_use(ws, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fails_cleanly(capsys, ws, ["up", "--prefect-port", "0", "--mlflow-port", str(port)],
                      f"--mlflow-port {port}: cannot listen on 127.0.0.1:{port}")
