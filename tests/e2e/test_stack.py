"""`r1 up` / `r1 down` for real: both servers answer and ask for logins, the worker reports, `r1 run` goes through
the stack with the logins `up` made and leaks them nowhere, `down` stops exactly what `up` started, and `up` right
after `down` starts again on the same ports."""

from __future__ import annotations

import base64
import json
import os
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import psutil
import pytest
import yaml

from browser import browser_missing, click, page_text, send_basic_auth, start_browser, wait_for
from flows.cli import stack
from flows.cli.credentials import CLIENT_VARS, read_credentials
from flows.cli.r1 import main
from tiny_configs import TINY_STAGE

ROOT = Path(__file__).resolve().parents[2]


def get(url: str, headers: dict | None = None, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                     method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def state_path_log(home: Path) -> Path:
    return home / "stack" / "logs" / f"worker-{stack.PROCESS_POOL}.log"


def basic(user_password: str) -> dict:
    return {"Authorization": "Basic " + base64.b64encode(user_password.encode()).decode()}


def r1(*args: str, env: dict) -> subprocess.CompletedProcess:
    """`r1 ...` as a user's shell runs it: its own process, the environment given and no login of its own."""
    env = {k: v for k, v in {**os.environ, **env}.items() if k not in CLIENT_VARS}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def the_stack_in_a_browser(profile: Path, state: dict, logins: dict, flow_run, stage_run) -> None:
    """Prefect's UI: a deep link asks for the login, then shows the deployments; a finished flow run's page shows its
    state and the graph of its task runs. MLflow's UI, with its login: the runs table, and a run's artifacts."""
    from selenium.webdriver.common.by import By

    driver = start_browser(profile)
    try:
        driver.get(f"{state['prefect_ui']}/deployments")
        box = wait_for("Prefect's login form", lambda: "/login" in driver.current_url and driver.find_elements(
            By.XPATH, "//input"), 60, driver)[0]
        box.send_keys(logins["PREFECT_API_AUTH_STRING"])
        wait_for("the Login button", lambda: click(driver, "//button[normalize-space()='Login']"), 30, driver)
        wait_for("the deployments page", lambda: driver.current_url.rstrip("/").endswith("/deployments") and all(
            name in page_text(driver) for name in ("cold_start_sft", "r1-process", "r1_pipeline")), 60, driver)
        driver.get(f"{state['prefect_ui']}/runs/flow-run/{flow_run.id}")
        wait_for("the flow run's page, Completed, with its graph", lambda: flow_run.name in page_text(driver)
                 and "Completed" in page_text(driver) and "Task runs" in page_text(driver)
                 and driver.find_elements(By.XPATH, "//div[contains(@class, 'flow-run-graph')]//canvas"), 60, driver)

        send_basic_auth(driver, logins["MLFLOW_TRACKING_USERNAME"], logins["MLFLOW_TRACKING_PASSWORD"])
        experiment = stage_run.info.experiment_id
        driver.get(f"{state['mlflow_ui']}/#/experiments/{experiment}/runs")
        wait_for("MLflow's runs table", lambda: all(x in page_text(driver) for x in (
            "r1_pipeline:through-the-stack", "cold_start_sft", "matching runs")), 60, driver)
        driver.get(f"{state['mlflow_ui']}/#/experiments/{experiment}/runs/{stage_run.info.run_id}/artifacts")
        wait_for("the stage run's artifacts", lambda: all(x in page_text(driver).splitlines() for x in (
            "checkpoint", "dataset", "eval")), 60, driver)
    finally:
        driver.quit()


def test_up_then_down(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("R1_HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    bystander = subprocess.Popen(["sleep", "3600"])  # a process `down` must leave alone (killed at the end)
    try:
        assert main(["up", "--prefect-port", "0", "--mlflow-port", "0"]) == 0
        out = capsys.readouterr().out
        state = json.loads((tmp_path / "stack" / "stack.json").read_text())
        # the logins: made once, 0600 in a 0700 folder, never printed (only where they are)
        logins = read_credentials(Path(state["auth"]))
        assert Path(state["auth"]) == tmp_path / "auth" / "credentials.env" and state["auth"] in out
        assert stat.S_IMODE(os.stat(state["auth"]).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "auth").st_mode) == 0o700
        secrets = [logins["PREFECT_API_AUTH_STRING"], logins["PREFECT_API_AUTH_STRING"].partition(":")[2],
                   logins["MLFLOW_TRACKING_PASSWORD"]]
        assert all(len(secret) >= 40 and secret not in out for secret in secrets)
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
        assert (tmp_path / "mlflow.db").exists() and (tmp_path / "prefect" / "prefect.db").exists()
        # no login, no API: each server refuses an unauthenticated call, a wrong login, and takes the right one
        prefect_login, mlflow_login = basic(logins["PREFECT_API_AUTH_STRING"]), \
            basic(f"{logins['MLFLOW_TRACKING_USERNAME']}:{logins['MLFLOW_TRACKING_PASSWORD']}")
        deployments, experiments = state["prefect_api"] + "/deployments/filter", \
            state["mlflow_ui"] + "/api/2.0/mlflow/experiments/search?max_results=5"
        assert get(deployments, data=b"{}") == 401 and get(deployments, basic("r1:wrong"), b"{}") == 401
        assert get(experiments) == 401 and get(experiments, basic("r1-admin:wrong")) == 401
        assert get(state["mlflow_ui"]) == 401  # the UI asks the browser for the login too
        assert get(state["mlflow_ui"], mlflow_login) == 200 and get(experiments, mlflow_login) == 200
        # every deployment is on the server
        with urllib.request.urlopen(urllib.request.Request(
                deployments, data=b"{}", method="POST",
                headers={"Content-Type": "application/json", **prefect_login}), timeout=10) as r:
            names = {d["name"] for d in json.load(r)}
        assert names == {"local", "gpu", "placed", "ray", "r1-process"}  # the pipeline's, and each stage's on r1-process

        assert main(["up", "--prefect-port", "0", "--mlflow-port", "0"]) == 1  # already up: starts nothing more
        assert "already up" in capsys.readouterr().out

        # `r1 run` through the stack, as `up` told: the two addresses exported, the logins read by `r1` itself
        recipe = tmp_path / "through-the-stack.yaml"
        recipe.write_text(yaml.safe_dump({"name": "through-the-stack", "cold_start_sft": {
            **TINY_STAGE, "data": {"num_train": 16, "num_heldout": 4}, "train": {**TINY_STAGE["train"], "max_steps": 2},
            "eval": {**TINY_STAGE["eval"], "num_prompts": 4, "num_samples": 1}}}))
        addresses = {"PREFECT_API_URL": state["prefect_api"], "MLFLOW_TRACKING_URI": state["mlflow_ui"],
                     "R1_HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect")}
        run = ["run", "--recipe", str(recipe), "--stages", "cold_start_sft"]
        done = r1(*run, env=addresses)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # and a stage's deployment run, as the UI starts one: the worker and its flow run send the logins
        import asyncio

        from prefect.client.orchestration import PrefectClient
        from prefect.client.schemas.objects import StateType
        from prefect.deployments import arun_deployment

        async def from_the_ui():
            async with PrefectClient(state["prefect_api"], auth_string=logins["PREFECT_API_AUTH_STRING"]) as client:
                return await arun_deployment("cold_start_sft/r1-process", client=client, timeout=300,
                                             parameters={"config": yaml.safe_load(recipe.read_text())[
                                                 "cold_start_sft"]}, poll_interval=2, as_subflow=False)

        flow_run = asyncio.run(from_the_ui())
        assert flow_run.state.type == StateType.COMPLETED, open(state_path_log(tmp_path)).read()[-3000:]
        # a wrong login is one line naming the server and the setting, before any stage: no run is made
        for wrong, setting in (({"PREFECT_API_AUTH_STRING": "r1:wrong"}, "PREFECT_API_AUTH_STRING"),
                               ({"MLFLOW_TRACKING_USERNAME": "r1-admin", "MLFLOW_TRACKING_PASSWORD": "wrong"},
                                "MLFLOW_TRACKING_PASSWORD")):
            env = {**addresses, **wrong}
            refused = subprocess.run([sys.executable, "-m", "flows.cli", *run], cwd=ROOT, capture_output=True,
                                     text=True, timeout=300, env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
            assert refused.returncode == 2, refused.stderr[-3000:]
            [line] = refused.stderr.strip().splitlines()
            assert setting in line and "refused" in line and "Traceback" not in refused.stderr
            assert ("Prefect" if setting.startswith("PREFECT") else "MLflow") in line
        # no login at all (a shell that points at the stack from another R1_HOME): the same line, saying what is unset
        from flows.checks import UsageError
        from flows.cli import preflight

        for name in CLIENT_VARS:
            monkeypatch.delenv(name, raising=False)
        with pytest.raises(UsageError, match="the Prefect server asks for a login .HTTP 401. and "
                                             "PREFECT_API_AUTH_STRING is not set"):
            preflight._check_prefect_login(state["prefect_api"])
        with pytest.raises(UsageError, match="the MLflow server asks for a login .HTTP 401. and "
                                             "MLFLOW_TRACKING_USERNAME is not set"):
            preflight._check_mlflow_login(state["mlflow_ui"])
        # the logins are nowhere in what the run left: MLflow params, tags, artifacts; Prefect parameters, logs
        import mlflow

        client = mlflow.MlflowClient(state["mlflow_ui"])
        os.environ.update({k: logins[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")})
        try:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
            # the pipeline run and its stage run, the deployment's stage run: the refused commands made none
            assert len(runs) == 3 and sum(r.info.status == "FINISHED" for r in runs) == 3
            left = [json.dumps([r.data.params, r.data.tags, r.data.metrics]) for r in runs]
            for r in runs:
                local = Path(mlflow.artifacts.download_artifacts(run_id=r.info.run_id, dst_path=str(tmp_path / "a"),
                                                                 tracking_uri=state["mlflow_ui"]))
                left += [f.read_bytes().decode("latin-1") for f in local.rglob("*") if f.is_file()]
        finally:
            for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                os.environ.pop(k, None)
        for path in ("/flow_runs/filter", "/logs/filter", "/task_runs/filter"):
            with urllib.request.urlopen(urllib.request.Request(
                    state["prefect_api"] + path, data=b"{}", method="POST",
                    headers={"Content-Type": "application/json", **prefect_login}), timeout=10) as r:
                left.append(r.read().decode())
        assert "cold_start_sft" in left[-3] and len(left) > 4  # there is something to search
        left += [log.read_text(errors="replace") for log in (tmp_path / "stack" / "logs").glob("*.log")]
        left += [done.stdout, done.stderr]
        assert not [secret for secret in secrets if any(secret in text for text in left)]

        # the stack as a team sees it, in a browser: both UIs behind their logins
        [stage_run] = [r for r in runs if r.data.tags.get("stage") == "cold_start_sft"
                       and r.data.tags.get("prefect.flow_run_id") != str(flow_run.id)]
        if reason := browser_missing():
            if os.environ.get("CI"):
                pytest.fail(f"{reason} (CI is set: `make test` installs them as root; see its output)")
            warnings.warn(f"r1 up's UIs not checked in a browser: {reason}")
        else:
            the_stack_in_a_browser(tmp_path / "chromium", state, logins, flow_run, stage_run)

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

        # up again at once, on the same ports the test's connections just left in TIME_WAIT, with the same logins
        ports = [str(int(state[k].rsplit(":", 1)[1].split("/")[0])) for k in ("prefect_ui", "mlflow_ui")]
        assert main(["up", "--prefect-port", ports[0], "--mlflow-port", ports[1]]) == 0, capsys.readouterr()
        capsys.readouterr()
        assert read_credentials(Path(state["auth"])) == logins
        assert get(experiments, mlflow_login) == 200 and get(experiments) == 401
        assert get(deployments, prefect_login, b"{}") == 200 and get(deployments, data=b"{}") == 401
        assert main(["down"]) == 0
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


def test_a_port_left_in_time_wait_is_free_to_up_and_serve():
    """`r1 down` then `r1 up`: the old connections' TIME_WAIT holds the port for a minute, which the servers (bound
    with SO_REUSEADDR) do not mind, and the port check no longer minds either; a listening socket still does."""
    from flows.checks import UsageError
    from flows.cli.preflight import check_port

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(UsageError, match=f"--prefect-port {port}: cannot listen"):
            check_port("--prefect-port", port)  # a server there
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server's side closes first, as an HTTP server does: its end waits in TIME_WAIT
        client.recv(1)
        client.close()
    with socket.socket() as plain, pytest.raises(OSError):  # what the check met before
        plain.bind(("127.0.0.1", port))
    check_port("--prefect-port", port)
    assert stack._port(port) == port


def test_r1_takes_the_logins_of_the_stack_its_environment_names(tmp_path, monkeypatch):
    """What `r1` does before Prefect loads: fills in the logins of the `r1 up` stack PREFECT_API_URL or
    MLFLOW_TRACKING_URI names (only what is unset), and names a stack an older `r1 up` started without logins."""
    from flows.cli.credentials import ensure_credentials, use_stack_credentials

    monkeypatch.setenv("R1_HOME", str(tmp_path))
    state = {"processes": [], "prefect_api": "http://127.0.0.1:4201/api", "prefect_ui": "http://127.0.0.1:4201",
             "mlflow_ui": "http://127.0.0.1:5001"}
    (tmp_path / "stack").mkdir()
    (tmp_path / "stack" / "stack.json").write_text(json.dumps(state))
    env = {"PREFECT_API_URL": "http://localhost:4201/api/", "MLFLOW_TRACKING_URI": "http://127.0.0.1:5001"}
    warning = use_stack_credentials(env)  # no logins: an older stack, said with what to do
    assert "without authentication by an older `r1 up`" in warning and "`r1 down`, then `r1 up`" in warning
    assert not set(CLIENT_VARS) & set(env)

    logins = ensure_credentials()
    assert ensure_credentials() == logins  # made once
    state["auth"] = str(tmp_path / "auth" / "credentials.env")
    (tmp_path / "stack" / "stack.json").write_text(json.dumps(state))
    assert use_stack_credentials(env) is None and {k: env[k] for k in CLIENT_VARS} == logins
    mine = {"PREFECT_API_URL": state["prefect_api"], "PREFECT_API_AUTH_STRING": "r1:mine",
            "MLFLOW_TRACKING_URI": "http://127.0.0.1:5001", "MLFLOW_TRACKING_USERNAME": "alice"}
    use_stack_credentials(mine)  # a login of one's own is kept, and not mixed with the stack's
    assert mine["PREFECT_API_AUTH_STRING"] == "r1:mine" and "MLFLOW_TRACKING_PASSWORD" not in mine
    elsewhere = {"PREFECT_API_URL": "http://127.0.0.1:4999/api"}
    assert use_stack_credentials(elsewhere) is None and elsewhere == {"PREFECT_API_URL": "http://127.0.0.1:4999/api"}
    # the file gone while MLflow's user store stays: its admin's password went with it, said before anything starts
    (tmp_path / "auth" / "mlflow-auth.db").write_bytes(b"")
    (tmp_path / "auth" / "credentials.env").unlink()
    with pytest.raises(RuntimeError, match="credentials.env is gone but MLflow's user store"):
        ensure_credentials()


STUBBORN = """
import signal, sys, time
seen = []
def on_term(signum, frame):
    seen.append(signum)
    print("SIGTERM", len(seen), flush=True)
    if len(seen) == 2 and sys.argv[1] == "second":
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("gives_in", ["second", "never"])
def test_a_process_that_does_not_stop_on_sigterm_gets_it_again_then_is_killed(tmp_path, gives_in):
    """`r1 down` (and the tests' servers) stop a group with SIGTERM, again after SECOND_SIGTERM_S (Prefect's worker
    kills itself then: a worker sometimes never finished its first, graceful stop), and SIGKILL at the timeout."""
    import time

    p = stack.start_process("stubborn", [sys.executable, "-c", STUBBORN, gives_in], dict(os.environ), tmp_path)
    log = Path(p.log)
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.stop_processes([p], timeout=stack.SECOND_SIGTERM_S + 5) == [True]
    assert not stack.is_running(p)
    assert log.read_text().split() == ["ready", "SIGTERM", "1", "SIGTERM", "2"]  # ended by the second, or killed
