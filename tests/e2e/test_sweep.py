"""`r1 sweep` for real: a 2 x 2 grid of the shortened tiny recipe's reasoning GRPO, its shared cold start trained
once, its table and plots in MLflow, the same command again training nothing, and bad input said in one line."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from flows.cli.r1 import main
from processes import ROOT, alive, kill_group, wait_for
from tiny_configs import TINY_GRPO, TINY_STAGE

# a cold start no other test trains (its seed), so the sweep's first point trains it and no earlier run stands in
COLD = {**TINY_STAGE, "data": {"num_train": 32, "num_heldout": 4}, "train": {**TINY_STAGE["train"], "seed": 41},
        "eval": {**TINY_STAGE["eval"], "num_prompts": 4, "num_samples": 1}}
GRPO = {**TINY_GRPO, "data": {"num_train": 16, "num_heldout": 4},
        "eval": {**TINY_GRPO["eval"], "num_prompts": 4}}
GRID = ["--grid", "reasoning_grpo.grpo.loss.beta=0,0.04",
        "--grid", "reasoning_grpo.grpo.optimizer.learning_rate=1e-5,1e-4"]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def stage_runs(client, pipeline_runs: list[str], stage: str) -> list:
    runs = []
    for run_id in pipeline_runs:
        experiment = client.get_run(run_id).info.experiment_id
        runs += client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{run_id}' and tags.stage = '{stage}'")
    return runs


def trained(runs) -> list:
    return [r for r in runs if "r1.reused_from" not in r.data.tags]


@pytest.fixture(scope="module")
def pool_servers(deployed_server, tmp_path_factory):
    """An MLflow server and a worker on the deployed server's process pool, shared by the module's tests that run
    on the pool (each logs under recipe names of its own); a folder for their files."""
    from flows.cli import stack

    root = tmp_path_factory.mktemp("sweep-pool")
    started = []
    try:
        mlflow_server, uri = stack.start_mlflow_server(root / "mlflow.db", root / "mlartifacts", stack.free_port(),
                                                       root / "logs")
        started.append(mlflow_server)
        # a pause after each training step: the cancelled sweep's points train until stopped, slowly, leaving the
        # cores to the rest of the suite (the finished sweep's short stages pause a second or so in all)
        started.append(stack.start_worker(deployed_server["api"], uri, root / "logs", PREFECT_WORKER_QUERY_SECONDS="2",
                                          OMP_NUM_THREADS="1", R1_STEP_PAUSE_S="0.3"))
        yield root, uri
    finally:
        stack.stop_processes(started[::-1])


@pytest.fixture
def pool(pool_servers, tmp_path, monkeypatch):
    """The pool's servers for one test (a folder of its own is yielded); this process logs to that MLflow server
    too, for the test's length."""
    _, uri = pool_servers
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    yield tmp_path


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"name": "sweep-test", "cold_start_sft": COLD, "reasoning_grpo": GRPO}))
    return path


def test_a_2x2_sweep_trains_its_shared_cold_start_once_and_again_trains_nothing(prefect_harness, mlflow_client,
                                                                                 recipe, capsys):
    args = ["sweep", "--recipe", str(recipe), *GRID, "--stages", "cold_start_sft,reasoning_grpo",
            "--set", "reasoning_grpo.eval.num_prompts=2"]  # a setting every point shares, not an axis
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "4 points" in out and "4 run now, 0 finished before" in out
    assert "every point with reasoning_grpo.eval.num_prompts=2" in out
    [sweep] = mlflow_client.search_runs([e.experiment_id for e in mlflow_client.search_experiments()],
                                        "tags.`r1.sweep.recipe` = 'sweep-test'")
    assert sweep.info.status == "FINISHED" and sweep.data.params["points"] == "4"
    points = mlflow_client.search_runs([sweep.info.experiment_id], f"tags.`r1.sweep` = '{sweep.info.run_id}'")
    assert len(points) == 4 and all(p.data.tags["mlflow.parentRunId"] == sweep.info.run_id for p in points)
    pipeline_runs = [p.info.run_id for p in points]
    # one cold start for the four points (the other three reuse it); a reasoning GRPO per point
    assert len(trained(stage_runs(mlflow_client, pipeline_runs, "cold_start_sft"))) == 1
    grpo = stage_runs(mlflow_client, pipeline_runs, "reasoning_grpo")
    assert len(trained(grpo)) == 4
    assert sorted((r.data.params["grpo.loss.beta"], r.data.params["grpo.optimizer.learning_rate"]) for r in grpo) == \
        [("0.0", "0.0001"), ("0.0", "1e-05"), ("0.04", "0.0001"), ("0.04", "1e-05")]
    assert {r.data.params["eval.num_prompts"] for r in grpo} == {"2"}

    # the table: four rows, each point's settings and its pipeline run's numbers
    folder = Path(mlflow_client.download_artifacts(sweep.info.run_id, "sweep", str(recipe.parent / "got")))
    table = pd.read_csv(folder / "points.csv")
    assert len(table) == 4 and set(table["pipeline_run"]) == set(pipeline_runs)
    settings = zip(table["reasoning_grpo.grpo.loss.beta"], table["reasoning_grpo.grpo.optimizer.learning_rate"])
    assert sorted(settings) == [(0.0, 1e-5), (0.0, 1e-4), (0.04, 1e-5), (0.04, 1e-4)]
    for _, row in table.iterrows():  # each row's numbers are its own pipeline run's
        run = mlflow_client.get_run(row["pipeline_run"])
        assert row["reasoning_grpo/eval/accuracy"] == pytest.approx(run.data.metrics["reasoning_grpo/eval/accuracy"])
    summary = pd.read_csv(folder / "summary.csv")
    assert len(summary) == 4 and (summary["seeds"] == 1).all()
    assert "reasoning_grpo/eval/accuracy mean" in summary
    # the plots: each final held-out number by each setting, and GRPO's curves overlaid (the cold start is shared)
    plots = sorted(p.name for p in (folder / "plots").glob("*.png"))
    assert "reasoning_grpo_eval_accuracy--reasoning_grpo.grpo.loss.beta.png" in plots
    assert "reasoning_grpo_eval_accuracy--reasoning_grpo.grpo.optimizer.learning_rate.png" in plots
    assert "curves--reasoning_grpo.png" in plots and "curves--cold_start_sft.png" not in plots
    assert not [p for p in plots if "num_prompts" in p]  # a shared setting gets no plot of its own
    assert all(png_size(folder / "plots" / p) == (640, 400) for p in plots)
    assert "sweep/points.json" in {a.path for a in mlflow_client.list_artifacts(sweep.info.run_id, "sweep")}
    assert "compare-runs" in out and "eval/accuracy" in out  # the links, the table

    # the same command again: every point finished before; nothing trains, no run is made but the sweep's reopening
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "0 run now, 4 finished before" in out
    again = mlflow_client.search_runs([sweep.info.experiment_id], f"tags.`r1.sweep` = '{sweep.info.run_id}'")
    assert len(again) == 4
    assert len(stage_runs(mlflow_client, pipeline_runs, "cold_start_sft")) == 4


@pytest.mark.parametrize("flags, said", [
    (["--grid", "reasoning_grpo.grpo.loss.betta=0,1"],
     "--grid reasoning_grpo.grpo.loss.betta=0: override 'reasoning_grpo.grpo.loss.betta': reasoning_grpo.grpo.loss has "
     "no field 'betta'"),
    (["--grid", "reasoning_grpo.grpo.loss.beta=0,-1"], "--grid reasoning_grpo.grpo.loss.beta=-1: "),
    (["--grid", "reasoning_grpo.grpo.loss.beta=0,0"], "--grid reasoning_grpo.grpo.loss.beta: 0 given twice"),
    (["--grid", "reasoning_grpo.grpo.loss.beta"], "--grid 'reasoning_grpo.grpo.loss.beta': expected PATH=V1,V2"),
    ([], "the sweep is empty"),
    (["--grid", "reasoning_grpo.grpo.loss.beta=0,1", "--seeds", "0"], "--seeds 0: expected 1 or more"),
    (["--grid", "reasoning_grpo.grpo.loss.beta=0,1", "--stages", "cold_start"], "unknown stage(s) ['cold_start']"),
    (["--grid", "reasoning_grpo.grpo.loss.beta=0,1", "--set", "reasoning_grpo.grpo.loss.betta=0"],
     "override 'reasoning_grpo.grpo.loss.betta': reasoning_grpo.grpo.loss has no field 'betta'"),
])
def test_a_sweep_asked_wrongly_is_one_line_before_anything_runs(recipe, flags, said, capsys):
    assert main(["sweep", "--recipe", str(recipe), *flags]) == 2
    err = capsys.readouterr().err
    [line] = err.strip().splitlines()
    assert said in line and "Traceback" not in err, line


def test_seeds_say_which_stages_they_reach(recipe):
    from grpo.configs.recipe import load_recipe
    from grpo.configs.sweep import SweepConfig
    from grpo.sweep import expand, seeds_reach, with_fixed

    r = load_recipe(recipe)
    late = SweepConfig(grid={"reasoning_grpo.grpo.loss.beta": [0, 0.04]}, seeds=2, seed_stages=["reasoning_grpo"],
                       stages=["cold_start_sft", "reasoning_grpo"])
    assert seeds_reach(r, late) == ("2 seeds reach reasoning_grpo: each seed trains its own reasoning_grpo and "
                                    "everything after it; cold_start_sft shared by all seeds")
    points = expand(r, late)
    assert [(p.settings["reasoning_grpo.grpo.loss.beta"], p.seed) for p in points] == [(0, 0), (0, 1), (0.04, 0),
                                                                                       (0.04, 1)]
    # GRPO's seed only
    assert points[1].overrides == {"reasoning_grpo.grpo.loss.beta": 0, "reasoning_grpo.grpo.seed": 1}
    shared = with_fixed(points, {"reasoning_grpo.grpo.loss.beta": 9, "cold_start_sft.train.max_steps": 3})
    assert shared[1].overrides == {"reasoning_grpo.grpo.loss.beta": 0, "cold_start_sft.train.max_steps": 3,
                                   "reasoning_grpo.grpo.seed": 1}  # the point's own setting wins
    every = SweepConfig(seeds=3, stages=["cold_start_sft", "reasoning_grpo"])
    assert "each seed trains its own cold_start_sft" in seeds_reach(r, every)
    assert expand(r, every)[2].overrides == {"cold_start_sft.train.seed": 43, "reasoning_grpo.grpo.seed": 2}


def test_a_sweep_killed_mid_point_goes_on_with_that_point_from_its_checkpoint(prefect_harness, mlflow_client,
                                                                              tmp_path, request):
    """kill -9 of `r1 sweep` while its first point's reasoning GRPO trains: the same command again goes on in the
    same sweep run, that point's cold start reused and its GRPO resumed from the checkpoint it wrote, then the
    second point; the dead process's runs are marked FAILED."""
    from prefect.settings import PREFECT_API_URL

    from grpo.training.checkpoints import latest_checkpoint
    from runtime import tracking

    grpo = {**GRPO, "grpo": {**GRPO["grpo"], "max_steps": 24, "checkpoint_every": 2, "seed": 5}}
    recipe = tmp_path / "killed.yaml"
    recipe.write_text(yaml.safe_dump({"name": "sweep-killed", "cold_start_sft": {
        **COLD, "train": {**COLD["train"], "seed": 42}}, "reasoning_grpo": grpo}))
    flags = ["--recipe", str(recipe), "--grid", "reasoning_grpo.grpo.loss.beta=0,0.04", "--stages",
             "cold_start_sft,reasoning_grpo"]
    # `r1 sweep` in a process of its own (and process group, as a terminal starts it), on the tests' Prefect API
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "sweep", *flags], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    request.addfinalizer(lambda: kill_group(proc.pid))

    def checkpoint():  # the first point's GRPO run, once it wrote a checkpoint
        parents = {r.info.run_id for r in tracking.find_runs("tags.recipe = 'sweep-killed'")}
        for run in tracking.find_runs("tags.stage = 'reasoning_grpo' and attributes.status = 'RUNNING'"):
            if run.data.tags.get("mlflow.parentRunId") in parents and "r1.work_dir.reasoning_grpo" in run.data.tags:
                found = latest_checkpoint(Path(run.data.tags["r1.work_dir.reasoning_grpo"]) / "checkpoints")
                return (run, found) if found is not None else None
        return None

    try:
        killed_grpo, _ = wait_for("a GRPO checkpoint of the first point", checkpoint, proc, every=0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    [sweep] = tracking.find_runs("tags.`r1.sweep.recipe` = 'sweep-killed'")
    assert sweep.info.status == "RUNNING"

    assert main(["sweep", *flags]) == 0
    assert tracking.client().get_run(sweep.info.run_id).info.status == "FINISHED"  # the same sweep run, finished
    assert tracking.client().get_run(killed_grpo.info.run_id).info.status == "FAILED"
    points = tracking.find_runs(f"tags.`r1.sweep` = '{sweep.info.run_id}' and attributes.status = 'FINISHED'")
    assert sorted(p.data.tags["r1.sweep.index"] for p in points) == ["0", "1"]
    [first] = [p for p in points if p.data.tags["r1.sweep.index"] == "0"]
    runs = {r.data.tags["stage"]: r for r in tracking.find_runs(f"tags.mlflow.parentRunId = '{first.info.run_id}'")}
    assert "r1.reused_from" in runs["cold_start_sft"].data.tags  # trained by the killed process, reused
    resumed = runs["reasoning_grpo"]
    step = int(resumed.data.tags["r1.resumed_from_step"])  # the checkpoint the killed process wrote
    assert 2 <= step < 24
    history = mlflow_client.get_metric_history(resumed.info.run_id, "reward/total")
    assert sorted(m.step for m in history) == list(range(step + 1, 25))  # only the steps after the checkpoint


def test_a_sweep_on_a_deployment_runs_its_points_on_a_pool_side_by_side(deployed_server, pool):
    """`r1 sweep --deployment r1_pipeline/local --parallel 2` on a real Prefect server with a worker on its pool:
    each point a flow run of the pipeline's deployment, logged to the same MLflow server; the second point starts
    only once the first has trained the cold start they share, which it then reuses."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.sweep import r1_sweep
    from runtime import tracking

    recipe = pool / "pool.yaml"
    recipe.write_text(yaml.safe_dump({"name": "sweep-pool", "cold_start_sft": COLD, "reasoning_grpo": GRPO}))
    with temporary_settings({PREFECT_API_URL: deployed_server["api"]}):
        result = r1_sweep(recipe=str(recipe), grid={"reasoning_grpo.grpo.loss.beta": [0, 0.04]},
                          stages=["cold_start_sft", "reasoning_grpo"], deployment="r1_pipeline/local", parallel=2)
    assert sorted(result.ran) == [0, 1]
    c = tracking.client()
    runs = [c.get_run(result.points[i]) for i in (0, 1)]
    assert all(r.info.status == "FINISHED" and r.data.tags["mlflow.parentRunId"] == result.run_id for r in runs)
    assert all(r.data.tags.get("prefect.flow_run_id") for r in runs)  # each a flow run of its own, on the worker
    cold = stage_runs(c, list(result.points.values()), "cold_start_sft")
    [trained_once] = trained(cold)
    second = c.get_run(result.points[1])
    assert second.info.start_time >= trained_once.info.end_time  # it waited for the shared cold start
    assert len(trained(stage_runs(c, list(result.points.values()), "reasoning_grpo"))) == 2


def test_variants_name_their_own_settings_and_stages(recipe, capsys):
    """A `sweep: variants:` section: each variant its own overrides and stages, crossed with seeds; points that share
    their first stages lead one another; a variant the recipe cannot take is one line naming it."""
    from flows.sweep import leaders
    from grpo.configs.recipe import load_recipe
    from grpo.sweep import expand

    r = load_recipe("unified_view")  # the shipped one: DeepSeekMath's rows
    points = expand(r, r.sweep)
    assert len(points) == 8 * 3
    by = {(p.settings["variant"], p.seed): p for p in points}
    assert by["ppo", 0].stages == ("cold_start_sft", "reasoning_grpo")
    assert by["ppo", 0].overrides == {"reasoning_grpo.algorithm": "ppo"}
    assert by["dpo", 2].stages[-1] == "alignment_grpo" and by["dpo", 2].overrides["alignment_grpo.dpo.seed"] == 2
    assert by["offline_rft", 1].overrides == {"reasoning_grpo.algorithm": "online_rft",
                                              "reasoning_grpo.online_rft.sampler": "initial",
                                              "reasoning_grpo.grpo.seed": 1}  # the seed reaches no cold start
    lead = leaders(r, points)
    # one cold start for all; each seed's alignment rows reuse that seed's GRPO outcome row, then one another's SFT
    assert lead[by["ppo", 2].index] == (0, ["cold_start_sft"])
    assert lead[by["rm_grpo", 1].index] == (by["grpo_outcome", 1].index, ["cold_start_sft", "reasoning_grpo"])
    assert lead[by["dpo", 1].index] == (by["rm_grpo", 1].index, ["cold_start_sft", "reasoning_grpo",
                                                                 "rejection_sampling", "sft"])

    data = yaml.safe_load(recipe.read_text())
    for variant, said in [({"reasoning_grpo.algorithm": "pp0"}, "variant bad: recipe 'sweep-test' with overrides: reasoning_grpo.algorithm"),
                          ({"reasoning_grpo.grpo.grading.supervision": "process"}, "variant bad: "),
                          ({"stages": ["cold_start"]}, "unknown stage(s) ['cold_start']")]:
        recipe.write_text(yaml.safe_dump({**data, "sweep": {"variants": {"good": {}, "bad": variant}}}))
        assert main(["sweep", "--recipe", str(recipe)]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert said in line, line


def _sweep_recipe(tmp_path: Path, name: str, seed: int, grpo_steps: int) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "cold_start_sft": {**COLD, "train": {**COLD["train"], "seed": seed}},
                                    "reasoning_grpo": {**GRPO, "grpo": {**GRPO["grpo"], "max_steps": grpo_steps}}}))
    return path


def test_points_side_by_side_on_this_machine_share_their_cold_start(prefect_harness, mlflow_client, tmp_path,
                                                                     capsys):
    """`r1 sweep --parallel 2` without a deployment: each point a process of its own on the sweep's Prefect API and
    MLflow store, the second started once the first has trained the cold start they share, which it reuses."""
    recipe = _sweep_recipe(tmp_path, "sweep-side", 47, 2)
    assert main(["sweep", "--recipe", str(recipe), "--grid", "reasoning_grpo.grpo.loss.beta=0,0.04", "--stages",
                 "cold_start_sft,reasoning_grpo", "--parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 run now, 0 finished before" in out
    [sweep] = mlflow_client.search_runs([e.experiment_id for e in mlflow_client.search_experiments()],
                                        "tags.`r1.sweep.recipe` = 'sweep-side'")
    points = mlflow_client.search_runs([sweep.info.experiment_id], f"tags.`r1.sweep` = '{sweep.info.run_id}'")
    assert sorted(p.data.tags["r1.sweep.index"] for p in points) == ["0", "1"]
    assert all(p.info.status == "FINISHED" and p.data.tags["mlflow.parentRunId"] == sweep.info.run_id
               for p in points)
    assert len({p.data.tags["r1.pid"] for p in points} | {str(os.getpid())}) == 3  # a process each, not this one
    [cold] = trained(stage_runs(mlflow_client, [p.info.run_id for p in points], "cold_start_sft"))
    second = next(p for p in points if p.data.tags["r1.sweep.index"] == "1")
    assert second.info.start_time >= cold.info.end_time  # it waited for the shared cold start
    assert len(trained(stage_runs(mlflow_client, [p.info.run_id for p in points], "reasoning_grpo"))) == 2
    assert sweep.info.status == "FINISHED" and "summary.csv" in out
    from runtime import tracking

    logs = tracking.r1_home() / "sweeps" / sweep.info.run_id / "points"
    assert "MLflow pipeline run" in (logs / "point-1.log").read_text()  # each point's own output, kept


def _until(what: str, check, timeout: float, every: float = 1.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"no {what} within {timeout} s")


def _running_points(recipe_name: str, count: int):
    """The sweep's point pipeline runs, once `count` of them train their cold start (RUNNING)."""
    from runtime import tracking

    parents = {r.info.run_id: r for r in tracking.find_runs(f"tags.recipe = '{recipe_name}'")}
    cold = [r for r in tracking.find_runs("tags.stage = 'cold_start_sft' and attributes.status = 'RUNNING'")
            if r.data.tags.get("mlflow.parentRunId") in parents]
    return [parents[r.data.tags["mlflow.parentRunId"]] for r in cold] if len(cold) >= count else None


def _stopped_sweep(tmp_path: Path, name: str) -> Path:
    """A sweep stopped while its two points train: a cold start of 500 steps, the points' seeds the only axis
    (TRAINING_SEEDS: they share no stage, so both start at once instead of the second waiting for the first to
    train what they share)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "cold_start_sft": {**COLD, "train": {**COLD["train"],
                                                                                      "max_steps": 500}}}))
    return path


TRAINING_SEEDS = ["--grid", "cold_start_sft.train.seed=48,49", "--stages", "cold_start_sft"]


def test_ctrl_c_stops_a_sweep_and_every_point_process_it_started(prefect_harness, tmp_path, request, monkeypatch):
    """Ctrl-C in the terminal (SIGINT to the process group) while two point processes train: `r1 sweep` exits 130
    within the 30 s a stop may take, no point process is left, and the sweep and its points are KILLED."""
    from prefect.settings import PREFECT_API_URL

    from runtime import tracking

    # a store of its own: twice in CI both points' ends waited out SQLite's 20 s for a lock held elsewhere, and the
    # session's store is written by the other worker's test files too (the sweep, its points and this test share it)
    monkeypatch.setenv("R1_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")

    recipe = _stopped_sweep(tmp_path, "sweep-ctrl-c")
    # the points train until stopped: slowly (a pause after each step), leaving the cores to the rest of the suite
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(ROOT), "R1_STEP_PAUSE_S": "0.3"}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "sweep", "--recipe", str(recipe), *TRAINING_SEEDS,
                             "--parallel", "2"], cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    request.addfinalizer(lambda: kill_group(proc.pid))
    points = wait_for("two points training side by side", lambda: _running_points("sweep-ctrl-c", 2), proc,
                      timeout=300, every=0.5)
    pids = [int(p.data.tags["r1.pid"]) for p in points]
    assert all(alive(pid) for pid in pids)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=60) == 130, proc.stdout.read().decode()[-3000:]
    assert not any(alive(pid) for pid in pids)
    [sweep] = tracking.find_runs("tags.`r1.sweep.recipe` = 'sweep-ctrl-c'")
    assert sweep.info.status == "KILLED"
    logs = "\n".join(f"--- {log.name}\n" + log.read_text(errors="replace")[-3000:]
                     for log in sorted((tracking.r1_home() / "sweeps" / sweep.info.run_id / "points").glob("*.log")))
    assert {tracking.client().get_run(p.info.run_id).info.status for p in points} == {"KILLED"}, logs


def test_a_sweep_cancelled_in_the_prefect_ui_stops_its_point_processes(deployed_server, pool):
    """The sweep deployment (`r1_sweep/local`) run by a worker, its two points as processes beside it; cancelled as
    the UI's Cancel does (the flow run set Cancelling): its flow run ends Cancelled, no point process is left, and the
    sweep and its points are KILLED in MLflow."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    from runtime import tracking

    recipe = _stopped_sweep(pool, "sweep-cancel")
    with temporary_settings({PREFECT_API_URL: deployed_server["api"]}):
        flow_run = run_deployment("r1_sweep/local", timeout=0, parameters={
            "recipe": str(recipe), "grid": {"cold_start_sft.train.seed": [48, 49]}, "stages": ["cold_start_sft"],
            "parallel": 2})
        points = _until("two points training side by side", lambda: _running_points("sweep-cancel", 2), 400)
        pids = [int(p.data.tags["r1.pid"]) for p in points]
        assert all(alive(pid) for pid in pids)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run.id, Cancelling(message="cancelled in the UI"), force=True)

            def cancelled():
                state = client.read_flow_run(flow_run.id).state
                return state if state.is_final() else None

            state = _until("end of the sweep's flow run", cancelled, 120)
    assert state.is_cancelled(), state
    _until("end of its point processes", lambda: not any(alive(pid) for pid in pids), 60, 0.5)
    # the runs' ends are written by the processes as they stop, which may land after Prefect's final state
    _until("the sweep's run ended KILLED", lambda: [r.info.status for r in tracking.find_runs(
        "tags.`r1.sweep.recipe` = 'sweep-cancel'")] == ["KILLED"], 60, 0.5)
    _until("its points' runs ended KILLED", lambda: {tracking.client().get_run(p.info.run_id).info.status
                                                      for p in points} == {"KILLED"}, 60, 0.5)
