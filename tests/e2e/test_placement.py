"""Stages placed on work pools of their own, for real: a Prefect server, an MLflow server and three process workers.

The pipeline itself runs as a deployment on a worker of its own (pool `r1-test-parent`); its stages alternate
between two more pools (`r1-test-a`, `r1-test-b`), each with one worker. Every worker has its own HOME, TMPDIR and
R1_HOME, and where the kernel allows a private mount namespace the other workers' folders and this test's own state
folder are covered by an empty tmpfs in its view: a stage can only get its inputs through the MLflow server, which is
all the workers share. Reasoning GRPO's pool has two workers: the one running it is killed with -9 (its flow run's
processes too) after the stage's first durable checkpoint, and the pipeline must resubmit the stage, which resumes
on the other worker from that checkpoint. The placed pipeline must end with the same figures as the same recipe run
in process, and leave no run RUNNING.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from flows.cli import stack
from ray_local import mount_namespace_prefix
from tiny_configs import ALL_STAGES

ROOT = Path(__file__).resolve().parents[2]
POOLS = {"cold_start_sft": "r1-test-a", "reasoning_grpo": "r1-test-b", "rejection_sampling": "r1-test-a",
         "sft": "r1-test-b", "alignment_grpo": "r1-test-a"}
PARENT_POOL = "r1-test-parent"


def placed_recipe() -> dict:
    """The tests' tiny recipe with every stage placed, alternating between the two pools."""
    recipe = {**ALL_STAGES, "name": "placed", "pools": {"r1-test-a": {"gpus": 0}, "r1-test-b": {"gpus": 0}}}
    for stage, pool in POOLS.items():
        recipe[stage] = {**recipe[stage], "resources": {"pool": pool, "cpus": "1", "memory": "2Gi",
                                                         "job_variables": {"env": {"R1_TEST_POOL": pool}}}}
    grpo = recipe["reasoning_grpo"]  # long enough to be killed between two checkpoints; one retry, at once
    recipe["reasoning_grpo"] = {**grpo, "grpo": {**grpo["grpo"], "max_steps": 16, "checkpoint_every": 2},
                                "resources": {**grpo["resources"], "retries": 1, "retry_delays_s": [0]}}
    return recipe


def start_worker(name: str, pool: str, root: Path, hide: list[Path], api: str, tracking: str,
                 namespace: list[str] | None) -> stack.Started:
    """A process worker whose flow runs see their own HOME, TMPDIR and R1_HOME, and (in a mount namespace) not
    `hide`."""
    home = root / name
    for d in ("home", "tmp", "r1"):
        (home / d).mkdir(parents=True, exist_ok=True)
    env = stack.base_env(PREFECT_API_URL=api, MLFLOW_TRACKING_URI=tracking, HOME=str(home / "home"),
                         TMPDIR=str(home / "tmp"), R1_HOME=str(home / "r1"), PREFECT_HOME=str(home / "home" / "prefect"),
                         PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="1",
                         R1_HEARTBEAT_S="1", R1_DURABLE_EVERY_S="0.2",  # a lost worker found in seconds
                         OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [str(stack.BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", name]
    if namespace:
        mounts = " && ".join(f"mount -t tmpfs -o size=4k,ro,mode=000 tmpfs {shlex.quote(str(h))}" for h in hide)
        argv = namespace + ["sh", "-c", f"{mounts} && exec {shlex.join(argv)}"]
    return stack.start_process(f"worker-{name}", argv, env, root / "logs")


def wait_for_workers(api: str, pools: list[str], timeout: float = 120) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            online = {p for p in pools if any(w.status == WorkerStatus.ONLINE
                                              for w in client.read_workers_for_work_pool(p))}
            if online == set(pools):
                return
            time.sleep(1)
    raise RuntimeError(f"workers did not come online on {pools}")


@pytest.fixture(scope="module")
def placed(deployed_server, tmp_path_factory, r1_home):
    """Pools, three workers, an MLflow server, the stage deployments `<stage>/<pool>` and the pipeline's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.deployments.runner import EntrypointType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessWorker

    from flows.cli.deploy import deploy_stages
    from flows.r1_pipeline import r1_pipeline
    from grpo.configs.recipe import Recipe

    api = deployed_server["api"]
    root = Path(tmp_path_factory.mktemp("placed"))
    shared = root / "shared"  # what every worker sees: the recipe file
    shared.mkdir()
    recipe_path = shared / "placed.yaml"
    recipe_path.write_text(yaml.safe_dump(placed_recipe()))
    started: list[stack.Started] = []
    try:
        mlflow, tracking = stack.start_mlflow_server(root / "mlflow" / "mlflow.db", root / "mlflow" / "artifacts",
                                                     stack.free_port(), root / "logs")
        started.append(mlflow)
        with temporary_settings({PREFECT_API_URL: api}):
            with get_client(sync_client=True) as client:
                for pool in (PARENT_POOL, *sorted(set(POOLS.values()))):
                    client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                            base_job_template=ProcessWorker.get_default_base_job_template()),
                                            overwrite=True)
            deploy_stages(Recipe.model_validate(placed_recipe()))
            r1_pipeline.to_deployment(name="test-parent", work_pool_name=PARENT_POOL,
                                      entrypoint_type=EntrypointType.MODULE_PATH).apply()
        namespace = mount_namespace_prefix()
        workers = {"parent": PARENT_POOL, "a": "r1-test-a", "b1": "r1-test-b", "b2": "r1-test-b"}
        for name, pool in workers.items():
            hide = [root / other for other in workers if other != name] + [r1_home, root / "mlflow"]
            for h in hide:
                h.mkdir(parents=True, exist_ok=True)
            started.append(start_worker(name, pool, root, hide, api, tracking, namespace))
        wait_for_workers(api, list(workers.values()))
        yield {"api": api, "tracking": tracking, "recipe": recipe_path, "root": root, "isolated": bool(namespace),
               "workers": {s.name.removeprefix("worker-"): s for s in started if s.name.startswith("worker-")}}
    finally:
        stack.stop_processes(started[::-1])  # together: a slow one costs its own wait, not the sum
        remove_pools(api, [PARENT_POOL, *sorted(set(POOLS.values()))])


def remove_pools(api: str, pools: list[str]) -> None:
    """The session's server as the fixture found it: the deployments this module made on its pools, then the pools
    (test_deployments, on the same server, counts every deployment)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        made = client.read_deployments(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=pools)))
        for deployment in made:
            client.delete_deployment(deployment.id)
        for pool in pools:
            client.delete_work_pool(pool)


def _kill_the_worker_running_grpo(placed) -> tuple[int, str]:
    """Once reasoning GRPO's first durable checkpoint is marked, kill -9 the worker running it and its flow run's
    processes; returns that checkpoint's step and the killed stage run."""
    import psutil

    from runtime import tracking
    from runtime.durable import marked_copies

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        runs = tracking.find_runs("tags.stage = 'reasoning_grpo' and attributes.status = 'RUNNING'")
        for run in runs:
            work = run.data.tags.get("r1.work_dir.reasoning_grpo")
            marked = [step for r, step in marked_copies(Path(work).name) if r == run.info.run_id] if work else []
            if marked:
                pid = int(run.data.tags["r1.pid"])
                for name, worker in placed["workers"].items():
                    tree = psutil.Process(worker.pid).children(recursive=True)
                    if any(p.pid == pid for p in tree):
                        for proc in [psutil.Process(worker.pid), *tree]:
                            proc.kill()
                        return marked[0], run.info.run_id
                raise AssertionError(f"no worker runs process {pid}")
        time.sleep(0.2)
    raise AssertionError("reasoning GRPO marked no durable checkpoint in time")


def _wait_final(flow_run_id, timeout: float):
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(2)
    raise AssertionError(f"the pipeline's flow run did not end within {timeout} s")


@contextmanager
def _tracking_on(uri: str):
    """This process's MLflow client pointed at `uri` for a while (the tests' own store otherwise)."""
    from runtime import tracking

    before = os.environ["MLFLOW_TRACKING_URI"]
    os.environ["MLFLOW_TRACKING_URI"] = uri  # tracking.client() reads it on every call
    try:
        yield
    finally:
        os.environ["MLFLOW_TRACKING_URI"] = before
        tracking.client()  # and sets mlflow's own URI back


def _flow_runs(api: str, tag: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))


def test_placed_stages_survive_a_killed_worker_and_match_the_in_process_run(placed, prefect_harness,
                                                                                   mlflow_client):
    from mlflow import MlflowClient
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.r1_pipeline import r1_pipeline

    with temporary_settings({PREFECT_API_URL: placed["api"]}):
        run = run_deployment("r1_pipeline/test-parent", parameters={"recipe": str(placed["recipe"])}, timeout=0)
        with _tracking_on(placed["tracking"]):
            step, killed = _kill_the_worker_running_grpo(placed)
        run = _wait_final(run.id, timeout=900)
    log = "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted((placed["root"] / "logs").glob("*.log")))
    assert run.state.is_completed(), f"{run.state}\n{log}"

    server = MlflowClient(placed["tracking"])
    [parent] = server.search_runs([server.get_experiment_by_name("r1-pipeline").experiment_id],
                                  "tags.recipe = 'placed'")
    assert parent.info.status == "FINISHED"
    children = server.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.tags["stage"] for c in children) == sorted([*POOLS, "reasoning_grpo"])

    # each stage was a flow run of its own, of its deployment on its pool, with the job variables its section asks;
    # reasoning GRPO twice: the one whose worker was killed (Crashed, its run FAILED) and the one that resumed
    runs = _flow_runs(placed["api"], f"r1.pipeline:{parent.info.run_id}")
    assert sorted(fr.name for fr in runs) == sorted([f"{s}:placed" for s in POOLS] + ["reasoning_grpo:placed"])
    for fr in runs:
        stage = fr.name.split(":")[0]
        assert fr.work_pool_name == POOLS[stage]
        assert fr.job_variables == {"cpu": "1", "memory": "2Gi", "env": {"R1_TEST_POOL": POOLS[stage]}}
        [child] = [c for c in children if c.data.tags["prefect.flow_run_id"] == str(fr.id)]  # the run it made
        assert child.data.tags["stage"] == stage
        assert fr.state.is_completed() == (child.info.run_id != killed), fr.state
    crashed = server.get_run(killed)
    assert crashed.info.status == "FAILED" and "heartbeat" in crashed.data.tags["r1.ended_because"]
    [resumed] = [c for c in children if c.data.tags["stage"] == "reasoning_grpo" and c.info.status == "FINISHED"]
    assert resumed.data.tags["r1.resumed_from_step"] == str(step)  # its durable checkpoint: a fresh disk
    assert resumed.data.tags["r1.resumed_from_run"] == killed
    assert "/b1/" in crashed.data.tags["r1.work_dir.reasoning_grpo"] + resumed.data.tags["r1.work_dir.reasoning_grpo"]
    assert "/b2/" in crashed.data.tags["r1.work_dir.reasoning_grpo"] + resumed.data.tags["r1.work_dir.reasoning_grpo"]
    assert not server.search_runs([parent.info.experiment_id], "attributes.status = 'RUNNING'")  # none left behind
    # the URIs went from stage to stage through MLflow: each stage read the one before it made on the other pool
    by_stage = {c.data.tags["stage"]: c for c in children if c.info.status == "FINISHED"}
    assert by_stage["reasoning_grpo"].data.params["input.checkpoint_uri"] == \
        f"runs:/{by_stage['cold_start_sft'].info.run_id}/checkpoint"

    # a retried pipeline run asks for a stage its earlier attempt placed: it gets that flow run's result, and no
    # second flow run is started (a running one would be waited on the same way)
    from flows.placement import run_placed
    from flows.stages import declared
    from grpo.configs.recipe import Recipe

    recipe = Recipe.model_validate(placed_recipe())
    with temporary_settings({PREFECT_API_URL: placed["api"]}), _tracking_on(placed["tracking"]):
        again = run_placed(declared()["cold_start_sft"], recipe.cold_start_sft, parent.info.run_id, {}, "placed",
                           logging.getLogger("test"))
    assert again.run_id == by_stage["cold_start_sft"].info.run_id
    assert len(_flow_runs(placed["api"], f"r1.pipeline:{parent.info.run_id}")) == len(POOLS) + 1

    # the same recipe in this process (same seeds, fp32): the same held-out figures, stage by stage
    overrides = {f"{stage}.resources.pool": None for stage in POOLS}
    local = r1_pipeline(recipe=str(placed["recipe"]), overrides=overrides, fresh=True)
    placed_metrics = {k: v for k, v in parent.data.metrics.items()}
    local_metrics = mlflow_client.get_run(local.run_id).data.metrics
    assert placed_metrics.keys() == local_metrics.keys()
    assert placed_metrics == pytest.approx(local_metrics, abs=1e-6)


def test_placement_mistakes_fail_before_any_stage(placed):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.checks import UsageError
    from flows.placement import check_placement
    from grpo.configs.recipe import Recipe

    def recipe(**changes) -> Recipe:
        data = placed_recipe()
        for stage, resources in changes.items():
            data[stage] = {**data[stage], "resources": resources}
            data["pools"][resources["pool"]] = {"gpus": 0}  # declared in the recipe: the server is what is wrong
        return Recipe.model_validate(data)

    with temporary_settings({PREFECT_API_URL: placed["api"]}):
        check_placement(recipe(), list(POOLS))  # the good one passes
        cases = {
            "no such work pool": recipe(cold_start_sft={"pool": "r1-test-a"}, sft={"pool": "r1-nowhere"}),
            "no worker is polling": recipe(sft={"pool": stack.GPU_POOL}),  # a pool with no worker
            "no deployment sft/r1-test-parent": recipe(sft={"pool": PARENT_POOL}),
        }
        for expected, bad in cases.items():
            with pytest.raises(UsageError, match=expected):
                check_placement(bad, list(POOLS))


def test_a_stage_asking_more_gpus_than_its_pool_gives_fails_when_the_recipe_is_read():
    from grpo.configs.recipe import Recipe, RecipeError, apply_overrides

    base = Recipe.model_validate(placed_recipe())
    with pytest.raises(RecipeError, match=r"reasoning_grpo.resources.gpus \(8\) is more than pool 'r1-test-b' can "
                                          r"give one flow run \(pools.r1-test-b.gpus: 0\)"):
        apply_overrides(base, {"reasoning_grpo.resources.gpus": 8})
    with pytest.raises(RecipeError, match="resources.pool 'r1-elsewhere' is not among the recipe's pools"):
        apply_overrides(base, {"sft.resources.pool": "r1-elsewhere"})
