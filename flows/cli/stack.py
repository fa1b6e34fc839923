"""A team's stack on one machine: `r1 up` starts it, `r1 down` stops it.

    r1 up     # a Prefect server, an MLflow server, a worker on the `r1-process` pool, every deployment
    r1 down   # stops exactly the processes `up` started (by PID), nothing else

`up` keeps its state under <R1_HOME>/stack: `stack.json` (each process's PID, its start time, and the addresses),
`logs/` (one log per process). Prefect's server keeps its SQLite under <R1_HOME>/prefect (the embedded default's
PREFECT_HOME, so earlier local runs stay visible) and MLflow its own at <R1_HOME>/mlflow.db with artifacts under
<R1_HOME>/mlartifacts, served through the MLflow server (`--serve-artifacts`), so clients never need the folder.

Both servers ask for credentials (flows.cli.credentials): made on the first `up`, kept under <R1_HOME>/auth with mode
0600, sent by the worker, its flow runs and every `r1` command pointed at the stack; never printed, only where they
are. An unauthenticated request to either API is refused (HTTP 401).

Each process starts in its own session (process group): `down` signals that group, which also ends what the process
started (a flow run under the worker, the MLflow server's workers), and checks the PID's start time first, so a PID
the system has since reused for another program is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from grpo.ports import free_port  # noqa: F401  (stack.free_port: what the stack's callers pick ports with)
from runtime.env import PROJECT_ROOT

PROCESS_POOL = "r1-process"
GPU_POOL = "r1-k8s-gpu"
FLOW_HEARTBEAT_S = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY of the workers' flow runs (Prefect's minimum)
INFERENCE_POOL = "r1-k8s-inference"  # rejection sampling's GPUs in recipes/gsm8k.yaml (same template, 1 GPU a run)
DEPLOYMENTS_FILE = PROJECT_ROOT / "deployments" / "prefect.yaml"
GPU_JOB_TEMPLATE = PROJECT_ROOT / "deployments" / "k8s-gpu-job-template.json"
BIN = Path(sys.executable).parent  # the venv's `prefect` and `mlflow` commands sit beside its python


# ---------------------------------------------------------------------------------------------- processes


@dataclass
class Started:
    """One process `up` started: enough to find it again (and only it) after `up` has exited."""

    name: str
    pid: int
    started_at: float  # the process's start time (psutil), so a reused PID is not mistaken for ours
    log: str


def start_process(name: str, argv: list[str], env: dict[str, str], log_dir: Path, cwd: Path = PROJECT_ROOT) -> Started:
    """Start `argv` in its own session with output to `<log_dir>/<name>.log`; it outlives the caller."""
    import psutil

    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return Started(name, proc.pid, psutil.Process(proc.pid).create_time(), str(log))


def is_running(p: Started) -> bool:
    import psutil

    try:
        proc = psutil.Process(p.pid)
        return abs(proc.create_time() - p.started_at) < 1 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# A second SIGTERM this long after the first, to the groups still there. Prefect's worker and server commands take
# the first as "finish and stop" and a second as "stop now" (they kill themselves), and uvicorn (both servers' own)
# exits at once on a second signal. A Prefect process worker that had run flow runs sometimes never finished its
# graceful stop on a busy machine (its log ends at "Sending SIGINT"): `r1 down` and the tests' teardowns waited out
# the whole timeout for it, then killed it.
SECOND_SIGTERM_S = 5.0


def stop_process(p: Started, timeout: float = 20) -> bool:
    """SIGTERM the process group `p` leads (again after SECOND_SIGTERM_S, SIGKILL after `timeout`); False if it was
    not running (or not ours)."""
    return stop_processes([p], timeout)[0]


def stop_processes(started: list[Started], timeout: float = 20) -> list[bool]:
    """`stop_process` for several at once: each group is sent SIGTERM in the order given, and all are waited on
    together, so a slow one costs its own wait and not the sum; those still there get SIGTERM again after
    SECOND_SIGTERM_S, and SIGKILL after `timeout`."""
    stopped = [is_running(p) for p in started]
    left = [p for p, running in zip(started, stopped) if running]
    second = min(SECOND_SIGTERM_S, timeout)
    for sig, wait in ((signal.SIGTERM, second), (signal.SIGTERM, timeout - second), (signal.SIGKILL, timeout)):
        for p in left:
            try:
                os.killpg(p.pid, sig)  # its own session: the group id is its PID
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            left = [p for p in left if not _reaped(p)]
            if left:
                time.sleep(0.2)
        if not left:
            break
    return [running and not is_running(p) for p, running in zip(started, stopped)]


def _reaped(p: Started) -> bool:
    """Whether `p` is gone: reaped here if it is our child (a test), else no longer running."""
    try:
        if os.waitpid(p.pid, os.WNOHANG)[0]:
            return True
    except ChildProcessError:
        pass
    return not is_running(p)


def wait_http(url: str, proc: Started, timeout: float = 180) -> None:
    """Wait until `url` answers 200; fail early (with the log's tail) if the process died, and stop it if not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if not is_running(proc):
            break
        time.sleep(0.5)
    stop_process(proc)  # not answering: do not leave it behind (the caller never got to record it)
    tail = Path(proc.log).read_text(errors="replace")[-3000:] if Path(proc.log).exists() else ""
    raise RuntimeError(f"{proc.name} did not answer {url} (see {proc.log}):\n{tail}")


def base_env(**extra: str) -> dict[str, str]:
    # flow runs send heartbeats, for the automation that marks a silent one Crashed (create_zombie_automation)
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PYTHONUNBUFFERED": "1",
           "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(FLOW_HEARTBEAT_S), **extra}
    # this checkout's packages first, for the worker's flow runs too (they import flows/, tasks/, runtime/, grpo/)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def start_prefect_server(home: Path, port: int, log_dir: Path, auth: dict[str, str] | None = None
                         ) -> tuple[Started, str]:
    """`prefect server start` with its own PREFECT_HOME and SQLite database, asking every API call for the
    credential in `auth` (flows.cli.credentials) where given; returns it and its API URL."""
    from flows.cli.credentials import prefect_server_env, prefect_ui_login_first

    from flows.cli import prefect_db

    home.mkdir(parents=True, exist_ok=True)
    api = f"http://127.0.0.1:{port}/api"
    db = home / "prefect.db"
    new = not db.exists() and not prefect_db.seed(prefect_db.default_database(home, f"sqlite+aiosqlite:///{db}"))
    # the UI's pages call the API at this URL; left unset it is built from the default port (4200), whatever
    # --port says, and the UI on any other port cannot reach its own server
    # with a login, the UI's pages are served from a folder of this home's, where a deep link is sent to the login
    ui = {"PREFECT_UI_STATIC_DIRECTORY": str(home / "ui")} if auth else {}
    env = base_env(PREFECT_HOME=str(home), PREFECT_SERVER_UI_API_URL=api, **ui,
                   PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
                   PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false", **(prefect_server_env(auth) if auth else {}))
    env.pop("PREFECT_API_URL", None)
    p = start_process("prefect-server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                         "--port", str(port)], env, log_dir)
    wait_http(f"{api}/health", p)
    if auth:
        prefect_ui_login_first(home / "ui")
    if new:
        prefect_db.keep(prefect_db.default_database(home, f"sqlite+aiosqlite:///{db}"))
    return p, api


def start_mlflow_server(db: Path, artifacts: Path, port: int, log_dir: Path, auth: dict[str, str] | None = None
                        ) -> tuple[Started, str]:
    """`mlflow server` on SQLite, serving artifacts from a local folder, behind its basic-auth app with the admin
    login in `auth` (flows.cli.credentials) where given; returns it and its tracking URI."""
    from flows.cli.credentials import mlflow_server_env

    from runtime import store_copies

    artifacts.mkdir(parents=True, exist_ok=True)
    store_copies.seed_mlflow(db)  # a new database from the migrated copy: the server starts without its migrations
    login = ["--app-name", "basic-auth"] if auth else []
    p = start_process("mlflow-server", [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{db}",
                                        "--artifacts-destination", str(artifacts), "--serve-artifacts",
                                        "--host", "127.0.0.1", "--port", str(port), "--workers", "1", *login],
                      # no job runner: its seven queue consumers serve GenAI features this project does not use
                      base_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", **(mlflow_server_env(auth) if auth else {})),
                      log_dir)
    uri = f"http://127.0.0.1:{port}"
    wait_http(f"{uri}/health", p)
    return p, uri


def start_worker(api_url: str, tracking_uri: str, log_dir: Path, pool: str = PROCESS_POOL,
                 **env: str) -> Started:
    """A process worker on `pool`; its flow runs inherit MLFLOW_TRACKING_URI (and `env`)."""
    return start_process(f"worker-{pool}", [str(BIN / "prefect"), "worker", "start", "--pool", pool,
                                            "--type", "process"],
                         base_env(PREFECT_API_URL=api_url, MLFLOW_TRACKING_URI=tracking_uri, **env), log_dir)


def create_work_pools(api_url: str, auth: dict[str, str] | None = None) -> None:
    """The process pool (Prefect's default process template) and the Kubernetes GPU pool (our template)."""
    import asyncio

    asyncio.run(_create_work_pools(api_url, _auth_string(auth)))


def _auth_string(auth: dict[str, str] | None) -> str | None:
    return auth["PREFECT_API_AUTH_STRING"] if auth else None


@contextlib.contextmanager
def prefect_api(api_url: str, auth: dict[str, str] | None = None):
    """Prefect's client settings for the server at `api_url` (with its credential), for the block."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: _auth_string(auth)}):
        yield


async def _create_work_pools(api_url: str, auth_string: str | None) -> None:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    pools = {PROCESS_POOL: ("process", ProcessWorker.get_default_base_job_template()),
             GPU_POOL: ("kubernetes", json.loads(GPU_JOB_TEMPLATE.read_text())),
             INFERENCE_POOL: ("kubernetes", json.loads(GPU_JOB_TEMPLATE.read_text()))}
    async with PrefectClient(api_url, auth_string=auth_string) as client:
        for name, (kind, template) in pools.items():
            await client.create_work_pool(WorkPoolCreate(name=name, type=kind, base_job_template=template,
                                                         description=pool_description(name)), overwrite=True)


def pool_description(pool: str) -> str:
    """What the UI shows under a pool: which worker serves it, and for those `r1 up` starts none, how to start one
    (the UI marks a pool no worker polls "Not Ready", with no word why)."""
    if pool == PROCESS_POOL:
        return ("Flow runs as processes on this machine. `r1 up` starts its worker (its log: "
                "<R1_HOME>/stack/logs/worker-r1-process.log); `r1 down` stops it.")
    return (f"Kubernetes jobs from deployments/k8s-gpu-job-template.json. `r1 up` starts no worker for it, so it shows "
            f"Not Ready and its runs wait (Late) until one polls: in the cluster, with PREFECT_API_URL pointing at this "
            f"server, `pip install prefect-kubernetes` and `prefect worker start --pool {pool} --type kubernetes`.")


ZOMBIE_AUTOMATION = "r1: crash flow runs whose heartbeat stopped"


def create_zombie_automation(api_url: str, within_s: int = 3 * FLOW_HEARTBEAT_S,
                             auth: dict[str, str] | None = None) -> None:
    """An automation on the server that marks Crashed a flow run whose heartbeats stopped (its pod preempted, its
    node lost, its worker killed), so it does not stay Running forever; the workers' flow runs send heartbeats."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    with prefect_api(api_url, auth):
        while (old := read_automation(ZOMBIE_AUTOMATION)) is not None:  # made again, not twice
            old.delete()
        Automation(
            name=ZOMBIE_AUTOMATION,
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"},
                expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                        "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                within=timedelta(seconds=within_s)),
            actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                        message=f"no heartbeat for {within_s} s: its machine or process is gone")],
        ).create()


def read_automation(name: str):
    """The server's automation of that name (the current API's), or None."""
    from prefect.automations import Automation

    try:
        return Automation.read(name=name)
    except ValueError:  # not found
        return None


def deploy_all(api_url: str, timeout: float = 300, auth: dict[str, str] | None = None) -> str:
    """`prefect deploy --all` with deployments/prefect.yaml (the pipeline's deployments), from the project root, then
    every stage's deployment on the process pool (`r1 deploy --pool r1-process`); returns what they printed."""
    proc = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
                           str(DEPLOYMENTS_FILE)], cwd=PROJECT_ROOT,
                          env=base_env(PREFECT_API_URL=api_url, **({"PREFECT_API_AUTH_STRING": _auth_string(auth)}
                                                                   if auth else {})),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"prefect deploy failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    made = deploy_stages_on(api_url, "tiny", PROCESS_POOL, auth, keep_existing=True)  # a user's settings stay
    return proc.stdout + "\n".join(f"deployed {name}" for name in made)


def deploy_stages_on(api_url: str, recipe: str, pool: str | None = None, auth: dict[str, str] | None = None,
                     keep_existing: bool = False) -> list[str]:
    """`r1 deploy --recipe <recipe> [--pool <pool>]` against the server at `api_url` (`keep_existing`: see
    flows.cli.deploy.deploy_stages)."""
    from flows.cli.deploy import deploy_stages
    from grpo.configs.recipe import load_recipe

    with prefect_api(api_url, auth):
        return deploy_stages(load_recipe(recipe), pool, keep_existing=keep_existing)


# ---------------------------------------------------------------------------------------------- r1 up / r1 down


def state_path() -> Path:
    from runtime.tracking import r1_home

    return r1_home() / "stack" / "stack.json"


def read_state() -> dict | None:
    path = state_path()
    return json.loads(path.read_text()) if path.exists() else None


def _write_state(state: dict) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state, indent=2))


def _processes(state: dict) -> list[Started]:
    return [Started(**p) for p in state.get("processes", [])]


def _port(port: int) -> int:
    """`port`, or a free one for 0; fails before anything starts if `port` is taken (as the servers see it: a
    port whose last connections wait out TIME_WAIT is free to them, as SO_REUSEADDR makes it)."""
    if port == 0:
        return free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise RuntimeError(f"port {port} is in use; pick another (0 picks a free one)") from None
    return port


def _wait_for_worker(api_url: str, pool: str, worker: Started, timeout: float = 120,
                     auth: dict[str, str] | None = None) -> None:
    import asyncio

    from prefect.client.orchestration import PrefectClient

    async def count() -> int:
        async with PrefectClient(api_url, auth_string=_auth_string(auth)) as client:
            return len(await client.read_workers_for_work_pool(pool))

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and is_running(worker):
        if asyncio.run(count()):
            return
        time.sleep(1)
    raise RuntimeError(f"the worker on {pool} did not report to the server (see {worker.log})")


def summary(state: dict) -> str:
    login = [f"logins     : in {state['auth']} (mode 0600; the Prefect UI asks for PREFECT_API_AUTH_STRING's "
             "value, the MLflow UI for MLFLOW_TRACKING_USERNAME's and _PASSWORD's)"] if state.get("auth") else \
        ["logins     : none (started by an older `r1 up`: `r1 down`, then `r1 up` adds them)"]
    export = [f"  set -a; . {state['auth']}; set +a   # the logins, for your own code (`r1` reads them itself)"] \
        if state.get("auth") else []
    return "\n".join([
        f"Prefect UI : {state['prefect_ui']}",
        f"MLflow UI  : {state['mlflow_ui']}",
        *login,
        f"worker     : pool {PROCESS_POOL} (logs under {state_path().parent / 'logs'})",
        "",
        "point `r1` and your own code at this stack:",
        f"  export PREFECT_API_URL={state['prefect_api']}",
        f"  export MLFLOW_TRACKING_URI={state['mlflow_ui']}",
        *export,
        "",
        f"run a deployment:  {BIN / 'prefect'} deployment run cold_start_sft/r1-process --flow-run-name "
        "cold_start_sft   (or from the UI: Deployments)",
        "stop everything :  r1 down",
    ])


def up(prefect_port: int = 4200, mlflow_port: int = 5000, out=print) -> int:
    """Start the stack, deploy every flow, record what was started; 0 on success."""
    from runtime.tracking import r1_home

    from flows.cli.credentials import credentials_path, ensure_credentials

    state = read_state()
    if state and any(is_running(p) for p in _processes(state)):
        if not state.get("auth"):
            out("r1: the stack is already up, started without authentication by an older `r1 up`: anyone who "
                "reaches its ports can use it; `r1 down`, then `r1 up` starts it again with logins (runs, "
                "artifacts and deployments are kept)\n\n" + summary(state))
        else:
            out("r1: the stack is already up (`r1 down` stops it)\n\n" + summary(state))
        return 1
    home, logs = r1_home(), state_path().parent / "logs"
    state = {"processes": []}
    try:
        prefect_port, mlflow_port = _port(prefect_port), _port(mlflow_port)
        auth = ensure_credentials()
        state["auth"] = str(credentials_path())
        out(f"starting the Prefect server on port {prefect_port} ...")
        server, api = start_prefect_server(Path(os.environ.get("PREFECT_HOME") or home / "prefect"), prefect_port,
                                           logs, auth)
        state["processes"].append(asdict(server))
        state.update(prefect_api=api, prefect_ui=api.removesuffix("/api"))
        _write_state(state)

        out(f"starting the MLflow server on port {mlflow_port} ...")
        mlflow, tracking = start_mlflow_server(home / "mlflow.db", home / "mlartifacts", mlflow_port, logs, auth)
        state["processes"].append(asdict(mlflow))
        state["mlflow_ui"] = tracking
        _write_state(state)

        out("creating work pools and deploying deployments/prefect.yaml ...")
        create_work_pools(api, auth)
        create_zombie_automation(api, auth=auth)
        (logs / "deploy.log").write_text(deploy_all(api, auth=auth))

        out(f"starting a worker on {PROCESS_POOL} ...")
        worker = start_worker(api, tracking, logs, **auth)  # its flow runs inherit the logins, never as parameters
        state["processes"].append(asdict(worker))
        _write_state(state)
        _wait_for_worker(api, PROCESS_POOL, worker, auth=auth)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        out(f"r1: up failed: {e}\nstopping what was started ...")
        down(out=out)
        return 1
    out("\n" + summary(state))
    return 0


def down(out=print) -> int:
    """Stop the processes `up` recorded (newest first), by PID; nothing else."""
    state = read_state()
    if not state:
        out("r1: nothing to stop (no stack state at " + str(state_path()) + ")")
        return 0
    for p in reversed(_processes(state)):
        if stop_process(p):
            out(f"stopped {p.name} (pid {p.pid})")
        else:
            out(f"{p.name} (pid {p.pid}) was not running")
    state_path().unlink()
    return 0
