"""A sweep as a flow: the recipe's pipeline once per point of a grid of settings and seeds, then a table and plots.

    r1 sweep --recipe tiny --grid reasoning_grpo.grpo.beta=0,0.04 --grid alignment_grpo.algorithm=grpo,dpo --seeds 3

Each point is a pipeline run (flows/r1_pipeline.py) with the point's settings as overrides, nested in MLflow under
the sweep's run (tasks/sweep.py). A point that shares its first stages with an earlier one reuses them (the stages'
keys are equal), so one cold start serves every point that does not change it.

Where points run:
- in this process (the default): one at a time, in the grid's order, each a subflow of this flow;
- as flow runs of a pipeline deployment (`deployment`, such as `r1_pipeline/placed`, whose stages go to their GPU
  pools), up to `parallel` at once: a team's sweep fills its pools. A point whose first stages an earlier point
  also runs waits until that point has finished them (its pipeline run records them), then reuses them, so the
  shared stages train once even with points side by side; the others start as soon as there is room. Each point's
  flow run is tagged `r1.sweep:<sweep run>` and `r1.sweep.point:<n>`: the same sweep again reattaches to those
  still running instead of starting them twice. Ctrl-C (or the sweep's own flow run cancelled) cancels them. The same sweep again (same recipe, grid, seeds, stages and code) goes on in the
same sweep run: a finished point is not run again, the interrupted one resumes as `r1 run` does (its finished
stages reused, its interrupted stage from its checkpoint). A sweep always reuses finished stages, its own and any
earlier run's with the same keys: that is what makes it cheap. To train a stage again, change one of its settings.

Must be started through `r1 sweep` or the flow itself; grpo/sweep.py checks the grid before this runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.r1_pipeline import r1_pipeline
from grpo.interrupts import is_interrupt
from grpo.recipe import STAGES, apply_overrides, load_recipe
from grpo.sweep import expand, seeds_reach
from grpo.sweep_config import SweepConfig
from tasks import sweep as results
from tasks import tracking
from tasks.stage import prefect_tags


class SweepResult(NamedTuple):
    run_id: str  # the sweep's MLflow run
    points: dict[int, str]  # point index -> its pipeline run
    table: str  # the summary as the terminal shows it
    files: dict[str, Any]  # points.csv, summary.csv, the plots (local copies of what the sweep run holds)
    ran: list[int]  # the points this call ran (the others had finished before)


def sweep_run_name() -> str:
    from flows.r1_pipeline import recipe_name

    return f"r1-sweep-{recipe_name(str(flow_run.parameters.get('recipe', 'tiny')))}"


def sweep_settings(recipe, grid: dict[str, list] | None, seeds: int | None, seed_stages: list[str] | None,
                   stages: list[str] | None) -> SweepConfig:
    """The sweep asked for: the flags over the recipe's own `sweep:` section, field by field."""
    base = recipe.sweep or SweepConfig()
    return SweepConfig(grid=grid or base.grid, seeds=seeds or base.seeds,
                       seed_stages=seed_stages if seed_stages is not None else base.seed_stages,
                       stages=stages if stages is not None else base.stages)


@flow(name="r1_sweep", flow_run_name=sweep_run_name, log_prints=True)
def r1_sweep(recipe: str = "tiny", grid: dict[str, list[Any]] | None = None, seeds: int | None = None,
             seed_stages: list[str] | None = None, stages: list[str] | None = None, deployment: str | None = None,
             parallel: int = 1) -> SweepResult:
    """Run every point of the sweep not yet finished, then log its table and plots on the sweep's MLflow run.

    `grid` maps recipe paths to the values they take; `seeds` runs each setting with seeds 0..seeds-1 (added to the
    training seeds of `seed_stages`); each overrides the recipe's `sweep:` section where given. `deployment` runs
    the points as that pipeline deployment's flow runs, `parallel` at once; without it they run here, in turn."""
    cfg = load_recipe(recipe)
    sweep = sweep_settings(cfg, grid, seeds, seed_stages, stages)
    points = expand(cfg, sweep)  # every point checked before anything runs
    order = [s for s in STAGES if s in (sweep.stages or STAGES)]
    log = get_run_logger()
    key = results.sweep_key(cfg, sweep, order)
    ended = tracking.end_dead_runs()  # what a killed earlier sweep left RUNNING: this sweep's run among them
    if ended:
        log.info("marked FAILED %d run(s) whose process had ended: %s", len(ended), ", ".join(ended))
    earlier = results.find_sweep_run(key)
    if earlier is not None:
        run_id = earlier.info.run_id
        if earlier.info.status == "RUNNING":  # its process lives: the same sweep twice at once would race
            tags = earlier.data.tags
            raise RuntimeError(f"this sweep is running already (MLflow run {run_id}, process {tags.get('r1.pid')} "
                               f"on {tags.get('r1.host')}): wait for it, or stop it and run this again")
        tracking.reopen_run(run_id)
        done = results.finished_points(run_id)
        log.info("going on with sweep run %s: %d of %d points finished before", run_id, len(done), len(points))
    else:
        run_id = tracking.start_run(f"r1_sweep:{cfg.name}", tags={
            results.KEY: key, "r1.sweep.recipe": cfg.name, "stages": ",".join(order), **prefect_tags()})
        tracking.log_params(run_id, {"recipe": cfg.name, "stages": ",".join(order), "seeds": sweep.seeds,
                                     "seed_stages": ",".join(sweep.seed_stages or order), "points": len(points),
                                     **{f"grid.{path}": ",".join(map(str, values))
                                        for path, values in sweep.grid.items()}})
        done = {}
    tracking.set_tags(run_id, {"r1.sweep.seeds_reach": seeds_reach(cfg, sweep)})
    runs: dict[int, str] = {}
    ran: list[int] = []
    try:
        for point in points:
            if point.key() in done:
                runs[point.index] = done[point.key()]
                print(f"{_where(point, points)}: finished before, pipeline run {done[point.key()]}")
        todo = [p for p in points if p.index not in runs]
        if deployment:
            ran = _on_deployment(deployment, recipe, cfg, order, points, todo, run_id, parallel, runs)
        for point in ([] if deployment else todo):
            print(f"{_where(point, points)}: running")
            result = r1_pipeline(recipe=recipe, stages=order, overrides=point.overrides,
                                 sweep=results.point_tags(run_id, point))
            runs[point.index] = result.run_id
            ran.append(point.index)
            print(f"{_where(point, points)}: done, pipeline run {result.run_id}")
        table, files = results.log_results(run_id, points, runs, order, _work(run_id))
    except BaseException as e:
        tracking.end_run(run_id, "KILLED" if is_interrupt(e) else "FAILED")
        raise
    tracking.end_run(run_id, "FINISHED")
    log.info("MLflow sweep run %s finished: %d points, %d run now", run_id, len(points), len(ran))
    return SweepResult(run_id, runs, table, files, ran)


def _where(point, points) -> str:
    return f"point {point.index + 1}/{len(points)} ({point.label()})"


def leaders(recipe, points, order: list[str]) -> dict[int, tuple[int, list[str]]]:
    """{point: (the earliest point sharing the most of its first stages, those stages)} for points that share any:
    two points share a stage when their settings agree on it and on every stage before it."""
    configs = {p.index: [getattr(apply_overrides(recipe, p.overrides), s).model_dump(mode="json") for s in order]
               for p in points}
    found = {}
    for p in points:
        best = (None, 0)
        for q in points[:p.index]:
            shared = next((i for i, (a, b) in enumerate(zip(configs[p.index], configs[q.index])) if a != b),
                          len(order))
            if shared > best[1]:
                best = (q.index, shared)
        if best[0] is not None:
            found[p.index] = (best[0], order[:best[1]])
    return found


def _on_deployment(deployment: str, recipe: str, cfg, order: list[str], points, todo, sweep_run_id: str,
                   parallel: int, runs: dict[int, str]) -> list[int]:
    """Run the `todo` points as flow runs of the pipeline deployment, up to `parallel` at once, each started once
    the stages it shares with an earlier point are finished; fills `runs`, returns the points run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.deployments import run_deployment

    from flows.placement import _client
    from flows.stages import finished_stages

    def tags(point) -> list[str]:
        return [f"r1.sweep:{sweep_run_id}", f"r1.sweep.point:{point.index}"]

    def pipeline_run(point, status: str | None = None) -> str | None:
        query = f"tags.`{results.SWEEP}` = '{sweep_run_id}' and tags.`{results.POINT}` = '{point.key()}'"
        found = tracking.find_runs(query + (f" and attributes.status = '{status}'" if status else ""))
        return found[0].info.run_id if found else None

    def ready(point) -> bool:  # its leader has finished the stages they share (or is gone: then it trains them)
        lead = leading.get(point.index)
        if lead is None or lead[0] in runs or lead[0] in failed:
            return True
        run = pipeline_run(points[lead[0]])
        return run is not None and set(lead[1]) <= set(finished_stages(run))

    leading = leaders(cfg, points, order)
    pending, running, failed, ran = list(todo), {}, set(), []
    with _client() as client:
        for point in todo:  # a flow run an earlier sweep process started, still going: waited on, not started twice
            earlier = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=tags(point))),
                                            limit=1)
            if earlier and earlier[0].state and not earlier[0].state.is_final():
                print(f"{_where(point, points)}: reattached to its flow run {earlier[0].name}")
                running[point.index] = earlier[0].id
                pending.remove(point)
    try:
        while pending or running:
            with _client() as client:
                for index, flow_run_id in list(running.items()):
                    state = client.read_flow_run(flow_run_id).state
                    if state is None or not state.is_final():
                        continue
                    del running[index]
                    if not state.is_completed():
                        failed.add(index)
                        raise RuntimeError(f"{_where(points[index], points)}: its flow run ended {state.name}"
                                           f"{': ' + state.message if state.message else ''}")
                    runs[index] = pipeline_run(points[index], "FINISHED")
                    if runs[index] is None:
                        raise RuntimeError(f"{_where(points[index], points)}: its flow run completed but no FINISHED "
                                           "pipeline run of it is in MLflow; do the sweep and the deployment's "
                                           "workers use the same tracking server?")
                    ran.append(index)
                    print(f"{_where(points[index], points)}: done, pipeline run {runs[index]}")
            for point in list(pending):
                if len(running) >= parallel:
                    break
                if not ready(point):
                    continue
                flow_run = run_deployment(deployment, timeout=0, tags=tags(point),
                                          flow_run_name=f"r1-{cfg.name}:point-{point.index + 1}",
                                          parameters={"recipe": recipe, "stages": order, "overrides": point.overrides,
                                                      "sweep": results.point_tags(sweep_run_id, point)})
                print(f"{_where(point, points)}: flow run {flow_run.name} of {deployment}")
                running[point.index] = flow_run.id
                pending.remove(point)
            if pending or running:
                time.sleep(POLL_S)
    except BaseException:
        from prefect.states import Cancelling

        with _client() as client:  # what this sweep started stops with it
            for flow_run_id in running.values():
                client.set_flow_run_state(flow_run_id, Cancelling(message="its sweep stopped"), force=True)
        raise
    return ran


POLL_S = 2.0  # how often the points' flow runs are read


def _work(run_id: str) -> Path:
    return tracking.r1_home() / "sweeps" / run_id
