"""A sweep as a flow: the recipe's pipeline once per point of a grid of settings and seeds, then a table and plots.

    r1 sweep --recipe tiny --grid reasoning_grpo.grpo.loss.beta=0,0.04 --grid alignment_grpo.algorithm=grpo,dpo \\
             --seeds 3

Each point is a pipeline run (flows/r1_pipeline.py) with the point's settings as overrides, nested in MLflow under
the sweep's run (runtime/sweep.py). A point that shares its first stages with an earlier one reuses them (the stages'
keys are equal), so one cold start serves every point that does not change it.

Where points run:
- in this process (the default): one at a time, in the grid's order, each a subflow of this flow;
- with `parallel` above 1, up to that many at once (flows/sweep_launch.py): as flow runs of a pipeline deployment
  (`deployment`, such as `r1_pipeline/placed`, whose stages go to their GPU pools: a team's sweep fills its pools),
  or without one as processes on this machine. A point whose first stages an earlier point also runs waits until
  that point has finished them, then reuses them, so shared stages train once even with points side by side.
  Ctrl-C (or the sweep's own flow run cancelled) stops them.

The same sweep again (same recipe, grid, variants, seeds, stages and code) goes on in the same sweep run: a finished
point is not run again, the interrupted one resumes as `r1 run` does (its finished stages reused, its interrupted
stage from its checkpoint). A sweep always reuses finished stages, its own and any earlier run's with the same keys:
that is what makes it cheap. To train a stage again, change one of its settings.

Must be started through `r1 sweep` or the flow itself; grpo/sweep.py checks the grid before this runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.r1_pipeline import r1_pipeline
from flows.sweep_launch import Deployment, Processes, side_by_side
from grpo import startup
from grpo.configs.recipe import STAGES, apply_overrides, load_recipe
from grpo.configs.sweep import SweepConfig
from grpo.interrupts import is_interrupt
from grpo.sweep import expand, seeds_reach, with_fixed
from runtime import sweep as results
from runtime import tracking
from runtime.stage import prefect_tags


class SweepResult(NamedTuple):
    run_id: str  # the sweep's MLflow run
    points: dict[int, str]  # point index -> its pipeline run
    table: str  # the summary as the terminal shows it
    files: dict[str, Any]  # points.csv, summary.csv, the plots (local copies of what the sweep run holds)
    ran: list[int]  # the points this call ran (the others had finished before)


def sweep_run_name() -> str:
    from flows.r1_pipeline import recipe_name

    startup.imports_done()  # a flow-run process's start-up ends as its run starts (flows/__init__.py)
    return f"r1-sweep-{recipe_name(str(flow_run.parameters.get('recipe', 'tiny')))}"


def sweep_settings(recipe, grid: dict[str, list] | None, seeds: int | None, seed_stages: list[str] | None,
                   stages: list[str] | None) -> SweepConfig:
    """The sweep asked for: the flags over the recipe's own `sweep:` section, field by field."""
    base = recipe.sweep or SweepConfig()
    return SweepConfig(grid=grid or base.grid, variants=base.variants, seeds=seeds or base.seeds,
                       seed_stages=seed_stages if seed_stages is not None else base.seed_stages,
                       stages=stages if stages is not None else base.stages)


@flow(name="r1_sweep", flow_run_name=sweep_run_name, log_prints=True)
def r1_sweep(recipe: str = "tiny", grid: dict[str, list[Any]] | None = None, seeds: int | None = None,
             seed_stages: list[str] | None = None, stages: list[str] | None = None, deployment: str | None = None,
             parallel: int = 1, overrides: dict[str, Any] | None = None) -> SweepResult:
    """Run every point of the sweep not yet finished, then log its table and plots on the sweep's MLflow run.

    `grid` maps recipe paths to the values they take; `seeds` runs each setting with seeds 0..seeds-1 (added to the
    training seeds of `seed_stages`); each overrides the recipe's `sweep:` section where given. `deployment` runs
    the points as that pipeline deployment's flow runs, `parallel` at once; without it they run here, in turn, or
    with `parallel` above 1 as that many processes at once. `overrides` are settings every point shares (`r1 sweep
    --set`): part of the sweep's recipe and of each point's overrides, not an axis."""
    cfg = apply_overrides(load_recipe(recipe), overrides or {})
    sweep = sweep_settings(cfg, grid, seeds, seed_stages, stages)
    points = with_fixed(expand(cfg, sweep), overrides or {})  # every point checked before anything runs
    order = [s for s in STAGES if any(s in p.stages for p in points)]  # every stage some point runs
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
                                        for path, values in sweep.grid.items()},
                                     **{f"variant.{name}": json.dumps(settings, default=str)[:6000]
                                        for name, settings in sweep.variants.items()},
                                     **{f"set.{path}": json.dumps(value, default=str)[:6000]
                                        for path, value in (overrides or {}).items()}})
        done = {}
    tracking.set_tags(run_id, {"r1.sweep.seeds_reach": seeds_reach(cfg, sweep)})
    runs: dict[int, str] = {}
    ran: list[int] = []
    ended: list[str] = []

    def end(e: BaseException) -> None:  # once: KILLED when stopped (Ctrl-C, a cancel), FAILED otherwise
        if not ended:
            ended.append(run_id)
            tracking.end_run(run_id, "KILLED" if is_interrupt(e) else "FAILED")

    def end_before_points(e: BaseException) -> None:
        # stopped by a supervisor (a worker cancelling the flow run, a SIGTERM), which kills this process after its
        # grace: the sweep's run ends first. A terminal's Ctrl-C reached the points too, and is waited for: they
        # end their own runs first, and the sweep's after them
        if not isinstance(e, KeyboardInterrupt):
            end(e)

    try:
        for point in points:
            if point.key() in done:
                runs[point.index] = done[point.key()]
                print(f"{_where(point, points)}: finished before, pipeline run {done[point.key()]}")
        todo = [p for p in points if p.index not in runs]
        if deployment or parallel > 1:
            launcher = Deployment(deployment, recipe, cfg.name, run_id) if deployment else \
                Processes(recipe, run_id, _work(run_id), parallel)
            ran = side_by_side(launcher, points, todo, leaders(cfg, points), run_id, parallel, runs,
                               lambda point: _where(point, points), before_stop=end_before_points)
        for point in ([] if deployment or parallel > 1 else todo):
            print(f"{_where(point, points)}: running")
            result = r1_pipeline(recipe=recipe, stages=list(point.stages), overrides=point.overrides,
                                 sweep=results.point_tags(run_id, point))
            runs[point.index] = result.run_id
            ran.append(point.index)
            print(f"{_where(point, points)}: done, pipeline run {result.run_id}")
        table, files = results.log_results(run_id, points, runs, order, _work(run_id))
    except BaseException as e:
        end(e)
        raise
    tracking.end_run(run_id, "FINISHED")
    log.info("MLflow sweep run %s finished: %d points, %d run now", run_id, len(points), len(ran))
    return SweepResult(run_id, runs, table, files, ran)


def _where(point, points) -> str:
    return f"point {point.index + 1}/{len(points)} ({point.label()})"


def leaders(recipe, points) -> dict[int, tuple[int, list[str]]]:
    """{point: (the earliest point sharing the most of its first stages, those stages)} for points that share any:
    two points share a stage when both run it and every stage before it, with the same settings."""
    configs = {p.index: [(s, getattr(apply_overrides(recipe, p.overrides), s).model_dump(mode="json"))
                         for s in p.stages] for p in points}
    found = {}
    for p in points:
        best = (None, 0)
        for q in points[:p.index]:
            mine, theirs = configs[p.index], configs[q.index]
            shared = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            if shared > best[1]:
                best = (q.index, shared)
        if best[0] is not None:
            found[p.index] = (best[0], list(p.stages[:best[1]]))
    return found


def _work(run_id: str) -> Path:
    return tracking.r1_home() / "sweeps" / run_id
