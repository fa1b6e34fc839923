"""A sweep's points side by side: as flow runs of a pipeline deployment, or as `r1` processes on this machine.

Both run up to `parallel` points at once, each started once the stages it shares with an earlier point are finished
(that point's pipeline run records them), so shared stages train once; the rest start as soon as there is room.

- `Deployment`: each point a flow run of the pipeline deployment (its stages on their pools), tagged
  `r1.sweep:<sweep run>` and `r1.sweep.point:<n>`; the same sweep again reattaches to those still running instead of
  starting them twice. Stopping the sweep cancels them.
- `Processes`: each point a process on this machine running its pipeline as `r1 run` would (flows/cli/point.py),
  on the sweep's Prefect API and MLflow store, its output in `<sweep folder>/points/point-<n>.log`, with an equal
  share of the machine's cores as its threads and a wait policy that does not spin (`grpo.cores`; what the user set
  in OMP_NUM_THREADS or OMP_WAIT_POLICY wins). Stopping the
  sweep stops them as Ctrl-C stops `r1 run`, with SIGINT (they end their runs KILLED; a SIGTERM would reach a point
  as Prefect's TerminationSignal, which can land inside a write to the store); one that has not ended 30 s later is
  killed. Each leads a process group of its own: a supervisor that stops the sweep's group (a Prefect worker
  cancelling its flow run sends SIGTERM, then SIGKILL 30 s later) reaches the sweep, which stops them, and does not
  kill a point halfway through ending its runs. They stop with the sweep's process, and one whose sweep is gone
  exits within a minute whatever it is doing (flows/cli/point.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from grpo import cores
from grpo.interrupts import die_with_parent
from runtime import sweep as results
from runtime import tracking

POLL_S = 2.0  # how often the points' runs are read
STOP_S = 30.0  # how long a stopped point process may take to end its runs


def pipeline_run(sweep_run_id: str, point, status: str | None = None) -> str | None:
    """The point's pipeline run in MLflow (the newest; with `status`, the newest in that status), or None."""
    query = f"tags.`{results.SWEEP}` = '{sweep_run_id}' and tags.`{results.POINT}` = '{point.key()}'"
    found = tracking.find_runs(query + (f" and attributes.status = '{status}'" if status else ""))
    return found[0].info.run_id if found else None


def side_by_side(launcher, points, todo, leading: dict[int, tuple[int, list[str]]], sweep_run_id: str,
                 parallel: int, runs: dict[int, str], where: Callable[[Any], str],
                 before_stop: Callable[[BaseException], None] | None = None) -> list[int]:
    """Run the `todo` points with `launcher`, up to `parallel` at once, each once its leader (`leading`: the earlier
    point it shares its first stages with, and those stages) has finished them; fills `runs`, returns the points
    run. Whatever it started is stopped when it stops, after `before_stop(why)`: the sweep's own run is ended
    first, as stopping the points may take longer than whoever stops this process waits."""
    from flows.stages import finished_stages

    def ready(point) -> bool:  # its leader has finished the stages they share (or is gone: then it trains them)
        lead = leading.get(point.index)
        if lead is None or lead[0] in runs or lead[0] in failed:
            return True
        run = pipeline_run(sweep_run_id, points[lead[0]])
        return run is not None and set(lead[1]) <= set(finished_stages(run))

    pending, running, failed, ran = list(todo), {}, set(), []
    for point in todo:  # started by an earlier sweep process and still going: waited on, not started twice
        handle = launcher.running_before(point)
        if handle is not None:
            print(f"{where(point)}: reattached to {launcher.describe(handle)}")
            running[point.index] = handle
            pending.remove(point)
    try:
        while pending or running:
            for index, handle in list(running.items()):
                ended = launcher.ended(handle)
                if ended is None:
                    continue
                del running[index]
                ok, why = ended
                if not ok:
                    failed.add(index)
                    raise RuntimeError(f"{where(points[index])}: {why}")
                runs[index] = pipeline_run(sweep_run_id, points[index], "FINISHED")
                if runs[index] is None:
                    raise RuntimeError(f"{where(points[index])}: it ended well but no FINISHED pipeline run of it is "
                                       "in MLflow; do the sweep and the points use the same tracking server?")
                ran.append(index)
                print(f"{where(points[index])}: done, pipeline run {runs[index]}")
            for point in list(pending):
                if len(running) >= parallel:
                    break
                if not ready(point):
                    continue
                running[point.index] = launcher.start(point)
                print(f"{where(point)}: {launcher.describe(running[point.index])}")
                pending.remove(point)
            if pending or running:
                time.sleep(POLL_S)
    except BaseException as e:
        try:
            if before_stop is not None:
                before_stop(e)
        finally:
            launcher.stop(list(running.values()))  # what this sweep started stops with it
        raise
    return ran


class Deployment:
    """Points as flow runs of a pipeline deployment (`r1_pipeline/placed`, say)."""

    def __init__(self, name: str, recipe: str, recipe_name: str, sweep_run_id: str):
        self.name, self.recipe, self.recipe_name, self.sweep_run_id = name, recipe, recipe_name, sweep_run_id
        self.names: dict[Any, str] = {}

    def _tags(self, point) -> list[str]:
        return [f"r1.sweep:{self.sweep_run_id}", f"r1.sweep.point:{point.index}"]

    def running_before(self, point):
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

        from flows.placement import prefect_client

        with prefect_client() as client:
            earlier = client.read_flow_runs(limit=1, flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=self._tags(point))))
        if earlier and earlier[0].state and not earlier[0].state.is_final():
            self.names[earlier[0].id] = earlier[0].name
            return earlier[0].id
        return None

    def start(self, point):
        from prefect.deployments import run_deployment

        flow_run = run_deployment(self.name, timeout=0, tags=self._tags(point),
                                  flow_run_name=f"r1-{self.recipe_name}:point-{point.index + 1}",
                                  parameters={"recipe": self.recipe, "stages": list(point.stages),
                                              "overrides": point.overrides,
                                              "sweep": results.point_tags(self.sweep_run_id, point)})
        self.names[flow_run.id] = flow_run.name
        return flow_run.id

    def describe(self, handle) -> str:
        return f"flow run {self.names.get(handle, handle)} of {self.name}"

    def ended(self, handle) -> tuple[bool, str] | None:
        from flows.placement import prefect_client

        with prefect_client() as client:
            state = client.read_flow_run(handle).state
        if state is None or not state.is_final():
            return None
        return state.is_completed(), f"its flow run ended {state.name}{': ' + state.message if state.message else ''}"

    def stop(self, handles: list) -> None:
        from prefect.states import Cancelling

        from flows.placement import prefect_client

        with prefect_client() as client:
            for flow_run_id in handles:
                client.set_flow_run_state(flow_run_id, Cancelling(message="its sweep stopped"), force=True)


def _die_with_the_sweep() -> None:
    """In a point process, between fork and exec: SIGINT when the sweep's process exits (see `Processes.stop`)."""
    die_with_parent(signal.SIGINT)


class Processes:
    """Points as processes on this machine, on this sweep's Prefect API and tracking store."""

    def __init__(self, recipe: str, sweep_run_id: str, work: Path, parallel: int):
        self.recipe, self.sweep_run_id, self.logs = recipe, sweep_run_id, work / "points"
        self.threads = cores.share(parallel)  # the machine's cores shared out
        self.logs.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        """A point process's environment: this one's, with its share of the cores (grpo.cores)."""
        return {**cores.shared_env(self.threads), "PYTHONUNBUFFERED": "1"}

    def running_before(self, point):
        return None  # a point process dies with the sweep that started it

    def start(self, point) -> subprocess.Popen:
        from prefect.settings import get_current_settings

        job = {"recipe": self.recipe, "stages": list(point.stages), "overrides": point.overrides,
               "sweep": results.point_tags(self.sweep_run_id, point)}
        env = self.env()
        api = get_current_settings().api.url  # this sweep's API (a server, or the one `r1` started for itself)
        if api:
            env["PREFECT_API_URL"] = str(api)
        log = self.logs / f"point-{point.index + 1}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "flows.cli.point", json.dumps(job)], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=_die_with_the_sweep, start_new_session=True)
        proc.log = log  # type: ignore[attr-defined]
        return proc

    def describe(self, proc) -> str:
        return f"process {proc.pid}, its output in {proc.log}"

    def ended(self, proc) -> tuple[bool, str] | None:
        code = proc.poll()
        if code is None:
            return None
        last = [line for line in proc.log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return code == 0, f"its process ended with exit code {code}{': ' + last[0] if last else ''} ({proc.log})"

    def stop(self, procs: list) -> None:
        for proc in procs:  # as a terminal's Ctrl-C stops `r1 run` (it reaches the sweep only: their own groups)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_S
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

