"""A stage on a work pool of its own: its deployment's flow run, with the job variables its recipe section asks for.

A stage whose `resources.pool` is set runs as the flow run of its deployment `<stage>/<pool>` (`r1 deploy` makes
them from the stage declarations), so reasoning GRPO lands on an 8-GPU node and rejection sampling on an inference
pool while the pipeline's own flow run, on a CPU pool, only waits. The stage flow run writes its result to its MLflow
run like any stage (runtime/report.py); the pipeline reads it from there, since the two share the tracking server and
nothing else.

Each stage flow run is tagged with the pipeline's MLflow run and the stage, so a pipeline run that is retried (or
rerun with the same parent, after its own pod died) finds the stage flow run it started: one still running or
completed is waited on or read, not started a second time.
"""

from __future__ import annotations

import time

from flows.checks import UsageError
from flows.stages import Stage
from grpo.configs.recipe import Recipe, StageConfig
from runtime import tracking
from runtime.stage import StageResult, read_result

POLL_S = 2.0  # how often the pipeline asks the server how its stage's flow run is doing


def deployment_name(stage: str, pool: str) -> str:
    return f"{stage}/{pool}"


def prefect_client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def check_placement(recipe: Recipe, stages: list[str]) -> None:
    """Before any stage starts: every placed stage's pool exists and has a worker polling it, and its deployment
    exists on that pool. (What a pool can give a flow run was checked when the recipe was read.)"""
    placed = {name: recipe.stage_configs()[name].resources.pool for name in stages}
    placed = {name: pool for name, pool in placed.items() if pool}
    if not placed:
        return
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api:
        name, pool = next(iter(placed.items()))
        raise UsageError(f"{name}.resources.pool {pool!r}: a stage placed on a work pool needs a Prefect server with "
                         "workers; set PREFECT_API_URL (`r1 up` starts one), or run it in process with "
                         f"--set {name}.resources.pool=null")
    with prefect_client() as client:
        for name, pool in placed.items():
            where = f"{name}.resources.pool {pool!r}"
            try:
                client.read_work_pool(pool)
            except ObjectNotFound:
                raise UsageError(f"{where}: the Prefect server {api} has no such work "
                                 f"pool; create it (prefect work-pool create {pool} --type ...) and start a worker "
                                 "on it") from None
            workers = client.read_workers_for_work_pool(pool)
            if not any(w.status == WorkerStatus.ONLINE for w in workers):
                raise UsageError(f"{where}: no worker is polling the pool; start one (prefect worker start --pool "
                                 f"{pool}) where the stage should run")
            try:
                deployment = client.read_deployment_by_name(deployment_name(name, pool))
            except ObjectNotFound:
                raise UsageError(f"{where}: no deployment {deployment_name(name, pool)}; `r1 deploy --recipe "
                                 f"{recipe.name}` makes one for every placed stage") from None
            if deployment.work_pool_name != pool:
                raise UsageError(f"{where}: deployment {deployment_name(name, pool)} runs on pool "
                                 f"{deployment.work_pool_name!r}; redeploy it (`r1 deploy --recipe {recipe.name}`)")


def _tags(parent_run_id: str, stage: str) -> list[str]:
    return [f"r1.pipeline:{parent_run_id}", f"r1.stage:{stage}"]


def _earlier_flow_run(client, parent_run_id: str, stage: str):
    """The newest flow run this pipeline run started for the stage, or None."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    tagged = FlowRunFilter(tags=FlowRunFilterTags(all_=_tags(parent_run_id, stage)))
    runs = client.read_flow_runs(flow_run_filter=tagged,
                                 sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
    return runs[0] if runs else None


def run_placed(stage: Stage, config: StageConfig, parent_run_id: str, inputs: dict[str, str],
               recipe_name: str, log) -> StageResult:
    """Run the stage as its deployment's flow run on its pool (or wait on the one this pipeline run started before)
    and return its result, read from its MLflow run."""
    from prefect.deployments import run_deployment

    pool = config.resources.pool
    with prefect_client() as client:
        earlier = _earlier_flow_run(client, parent_run_id, stage.name)
    if earlier is not None and (not earlier.state or not earlier.state.is_final() or earlier.state.is_completed()):
        log.info("%s: reattaching to its flow run %s (%s)", stage.name, earlier.name,
                 earlier.state.name if earlier.state else "no state yet")
        flow_run_id = earlier.id
    else:
        variables = config.resources.as_job_variables()
        flow_run = run_deployment(deployment_name(stage.name, pool), timeout=0,
                                  parameters={"config": config.model_dump(mode="json"), "parent_run_id": parent_run_id,
                                              **inputs},
                                  job_variables=variables, flow_run_name=f"{stage.name}:{recipe_name}",
                                  tags=_tags(parent_run_id, stage.name))
        log.info("%s: flow run %s on pool %s with job variables %s", stage.name, flow_run.name, pool, variables)
        flow_run_id = flow_run.id
    state = _wait(flow_run_id, stage.name, log, config.resources.timeout_s)
    if not state.is_completed():
        raise RuntimeError(f"{stage.name}: its flow run on pool {pool!r} ended {state.name}"
                           f"{': ' + state.message if state.message else ''}")
    return _result_of(flow_run_id, stage.name)


def _wait(flow_run_id, stage: str, log, timeout_s: float | None = None):
    """The flow run's final state, logging each state it passes through. A flow run whose stage run stopped beating
    (its pod or node gone, its process killed) is marked Crashed; one that runs past `timeout_s` is cancelled."""
    from prefect.states import Cancelling, Crashed

    seen, started = None, time.monotonic()
    with prefect_client() as client:
        while True:
            state = client.read_flow_run(flow_run_id).state
            if state is not None and state.name != seen:
                seen = state.name
                log.info("%s: flow run %s", stage, state.name)
            if state is not None and state.is_final():
                return state
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                client.set_flow_run_state(flow_run_id, Cancelling(message=f"past its timeout of {timeout_s:g} s"),
                                          force=True)
                raise TimeoutError(f"{stage}: its flow run ran past resources.timeout_s ({timeout_s:g} s)")
            gone = _stopped_beating(flow_run_id, stage)
            if gone is not None:
                why = f"the heartbeat of its MLflow run {gone} stopped: its process, pod or node is gone"
                tracking.set_tags(gone, {"r1.ended_because": why})
                tracking.end_run(gone, "FAILED")
                crashed = Crashed(message=why)
                client.set_flow_run_state(flow_run_id, crashed, force=True)
                log.warning("%s: %s", stage, why)
                return crashed
            time.sleep(POLL_S)


def _stopped_beating(flow_run_id, stage: str) -> str | None:
    """The stage's RUNNING MLflow run in that flow run, if its heartbeat stopped."""
    from runtime import heartbeat

    runs = tracking.find_runs(f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.stage = '{stage}' and "
                              "attributes.status = 'RUNNING'")
    return next((r.info.run_id for r in runs if heartbeat.is_stale(r.data.tags)), None)


def _result_of(flow_run_id, stage: str) -> StageResult:
    """The result a completed stage flow run recorded on its MLflow run (runtime.stage.record_result)."""
    runs = tracking.find_runs(f"tags.`prefect.flow_run_id` = '{flow_run_id}' and tags.stage = '{stage}' and "
                              "attributes.status = 'FINISHED'")
    for run in runs:  # newest first
        result = read_result(run)
        if result is not None:
            return result
    raise RuntimeError(f"{stage}: its flow run {flow_run_id} completed but no FINISHED MLflow run of it records a "
                       f"result; do the pipeline and the stage's worker use the same tracking server?")

