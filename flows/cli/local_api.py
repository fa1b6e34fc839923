"""The embedded default's Prefect API: a local server that `r1` starts for one run, in a session of its own.

With no `PREFECT_API_URL`, Prefect would start a temporary API as a child in the caller's process group. A terminal's
Ctrl-C (SIGINT to the whole foreground group), `timeout` or a job scheduler (SIGTERM to the group) then kills the API
first, and the flow spends minutes retrying it to record how it ended. Here the same server (Prefect's API app under
uvicorn, UI off, on 127.0.0.1, its SQLite under PREFECT_HOME) starts in a session of its own: no signal meant for the
run reaches it, the run records its end, and `r1` stops the server last. If `r1` itself is killed (-9), the kernel
ends the server with it (PR_SET_PDEATHSIG, Linux), as Prefect's own temporary server would have ended.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from flows.cli import prefect_db
from grpo.interrupts import die_with_parent
from grpo.ports import free_port
from runtime.env import LOCAL_API

LOCAL_UI_PORT = 4200  # where `r1 up` (and a bare `prefect server start` on the home) serves the Prefect UI


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # a session (and process group) of its own: a terminal's signals to ours do not reach it
    die_with_parent(signal.SIGTERM)




def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass
class _Starting:
    """A local API's server process, started and not yet answering; the home's lock held until it answers."""
    proc: subprocess.Popen
    url: str
    log: Path
    lock: IO[str]
    db: Path | None
    new: bool  # a new home's database made by Prefect's migrations: a copy is kept once the server answers


_early: _Starting | None = None  # started by `start_early`, taken by the next `local_prefect_api`


def _configured() -> bool:
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)  # a server in the environment or a profile (or a test harness's)


def _start(home: Path | None = None) -> _Starting:
    from prefect.settings import get_current_settings

    home = Path(home or os.environ["PREFECT_HOME"]).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
           "PREFECT_HOME": str(home), "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
           "PREFECT__SERVER_FINAL": "1"}
    env.pop("PREFECT_API_URL", None)
    log = home / "local-api.log"
    # a server migrates its database as it starts: two `r1` starting at once on one home would both create its
    # tables, and one would fail; the second waits until the first answers, then finds the tables made
    lock = (home / "local-api.lock").open("a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        db = prefect_db.default_database(home)
        new = db is not None and not db.exists() and not prefect_db.seed(db)  # a new home, and no migrated copy
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory",
                                     "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port",
                                     str(port), "--log-level", "error", "--lifespan", "on"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=_die_with_parent)
    except BaseException:
        lock.close()
        raise
    return _Starting(proc, url, log, lock, db, new)


def _answering(starting: _Starting) -> str:
    """Wait until the server answers (its lock released either way); its URL. A server that does not is stopped."""
    try:
        _wait_healthy(starting.url, starting.proc, starting.log,
                      float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 120)))
        if starting.new:
            prefect_db.keep(starting.db)
    except BaseException:
        _stop(starting.proc)
        raise
    finally:
        starting.lock.close()  # and with it the lock
    return starting.url


def start_early() -> None:
    """Start the local API now where a run will need it (no server configured), so that it comes up while `r1` loads
    the stages' libraries (~5 s of a 2-core CPU each): `local_prefect_api` takes it. `stop_early` stops it if no
    run came to take it (a check failed)."""
    global _early
    if _early is None and not _configured():
        _early = _start()


def stop_early() -> None:
    global _early
    if _early is not None:
        _stop(_early.proc)
        _early.lock.close()
        _early = None


@contextmanager
def local_prefect_api(export: bool = True, home: Path | None = None) -> Iterator[str | None]:
    """Within the block, Prefect talks to a local API this process started (its URL is yielded; the one
    `start_early` started, if it did); with an API already configured (`PREFECT_API_URL`: a real server), nothing
    starts and None is yielded. `export`: the processes this one starts meanwhile are given its URL too (their
    environment's PREFECT_API_URL); without it only this process's Prefect settings name it. `home`: the server's
    PREFECT_HOME (its database's folder), PREFECT_HOME's by default."""
    global _early
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    starting, _early = _early, None
    if starting is None:
        if _configured():
            yield None
            return
        starting = _start(home)
    url = _answering(starting)
    proc = starting.proc
    # Prefect's "View at <UI>/runs/flow-run/<id>" lines would name this temporary API's port, where no UI is served
    # and nothing answers once the run ends: they name the UI that serves this home's runs instead (`r1 where`)
    users_ui = os.environ.get("PREFECT_UI_URL")
    ui = users_ui or f"http://127.0.0.1:{LOCAL_UI_PORT}"
    try:
        if export:
            os.environ["PREFECT_API_URL"] = os.environ[LOCAL_API] = url  # for what this process starts, too
            os.environ["PREFECT_UI_URL"] = ui
        try:
            with temporary_settings({PREFECT_API_URL: url, PREFECT_UI_URL: ui}):
                yield url
        finally:
            _drain_prefect_clients()  # what the run logged and emitted reaches the API before the API stops
            if export:
                for name in ("PREFECT_API_URL", LOCAL_API, "PREFECT_UI_URL"):
                    os.environ.pop(name, None)
                if users_ui:
                    os.environ["PREFECT_UI_URL"] = users_ui
    finally:
        _stop(proc)


def _drain_prefect_clients(timeout: float = 10) -> None:
    """Send the logs and events Prefect still queues (it sends them in the background, and at exit would retry
    a stopped API for minutes), while the API is up."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"the local Prefect API did not start within {timeout:.0f} s (see {log}):\n{tail}")
