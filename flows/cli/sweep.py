"""`r1 sweep`: the recipe over a grid of its settings and seeds, each point a pipeline run, compared at the end.

    r1 sweep --recipe tiny --grid reasoning_grpo.grpo.loss.beta=0,0.04 --grid alignment_grpo.algorithm=grpo,dpo \\
             [--seeds 3] [--seed-stages reasoning_grpo,...] [--stages cold_start_sft,reasoning_grpo]

Everything is checked first, each point's recipe as `r1 run` checks one (a setting the recipe has not, a value it
does not take, an empty grid, a seed count below 1: one line naming the setting and the value). Then the points run
(flows/sweep.py), each told as it starts and ends, and the terminal ends with the summary table, the files and the
MLflow UI's pages: the sweep run, and the comparison of its points' pipeline runs.
"""

from __future__ import annotations

import argparse


def add_parser(sub, parents) -> None:
    sweep = sub.add_parser("sweep", parents=parents,
                           help="run the recipe over a grid of settings and seeds; compare the points")
    sweep.add_argument("--recipe", default="tiny", help="recipe name under recipes/ or a YAML path (its `sweep:` "
                                                        "section is the default grid)")
    sweep.add_argument("--grid", action="append", default=[], metavar="PATH=V1,V2",
                       help="a recipe field by dotted path and the values it takes, each read as YAML "
                            "(reasoning_grpo.grpo.loss.beta=0,0.04); repeatable: the points are the product")
    sweep.add_argument("--seeds", type=int, default=None, help="seeds per setting (default: the recipe's sweep "
                                                               "section, else 1)")
    sweep.add_argument("--seed-stages", default=None,
                       help="comma-separated stages a seed reaches (default: every stage the sweep runs)")
    sweep.add_argument("--stages", default=None, help="comma-separated stages each point runs (default: all five)")
    sweep.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                       help="a recipe field every point shares, by its dotted path, the value read as YAML "
                            "(cold_start_sft.train.max_steps=20); repeatable. Not an axis: a --grid of the same "
                            "path wins")
    sweep.add_argument("--deployment", default=None,
                       help="run the points as flow runs of this pipeline deployment (r1_pipeline/placed, say: its "
                            "stages on their pools) on the Prefect server PREFECT_API_URL names")
    sweep.add_argument("--parallel", type=int, default=1,
                       help="points running at once: flow runs of --deployment, or without it processes on this "
                            "machine, sharing its cores (default: 1, in this process)")


def run(args: argparse.Namespace, until_stopped) -> int:
    """The command; `until_stopped(run, resumes)` runs the flow as `r1 run` does (flows.cli.r1.until_stopped)."""
    from flows.checks import UsageError
    from flows.cli import preflight
    from flows.cli.preflight import parse_overrides
    from flows.sweep import sweep_settings
    from grpo.configs.recipe import STAGES, apply_overrides, load_recipe
    from grpo.sweep import SweepError, expand, parse_grid, seeds_reach, with_fixed

    fixed = parse_overrides(args.overrides)
    recipe = apply_overrides(load_recipe(args.recipe), fixed)  # every point's settings, checked once
    if args.seeds is not None and args.seeds < 1:
        raise UsageError(f"--seeds {args.seeds}: expected 1 or more")
    if args.parallel < 1:
        raise UsageError(f"--parallel {args.parallel}: expected 1 or more")
    stages = preflight.check_stages(_names(args.stages)) if args.stages else None
    seed_stages = preflight.check_stages(_names(args.seed_stages)) if args.seed_stages else None
    try:
        sweep = sweep_settings(recipe, parse_grid(args.grid), args.seeds, seed_stages, stages)
        points = with_fixed(expand(recipe, sweep), fixed)
    except SweepError as e:
        raise UsageError(str(e)) from None
    order = preflight.check_stages([s for s in STAGES if any(s in p.stages for p in points)])
    preflight.check_servers()
    if args.deployment:
        check_deployment(args.deployment)
    from flows.placement import check_placement

    for point in points:  # each point's recipe as `r1 run` checks it, before any point runs
        point_recipe = apply_overrides(recipe, point.overrides)
        try:
            check_placement(point_recipe, list(point.stages))
            preflight.check_recipe(point_recipe, list(point.stages))
            preflight.check_precision(point_recipe, list(point.stages))
            preflight.check_distributed(point_recipe, list(point.stages))
        except UsageError as e:
            raise UsageError(f"the point {point.label()}: {e}") from None
    grid = "; ".join([*([f"variants {', '.join(sweep.variants)}"] if sweep.variants else []),
                      *(f"{path} in {', '.join(_short(v) for v in values)}" for path, values in sweep.grid.items())]) \
        or "no grid"
    shared = f"; every point with {', '.join(f'{k}={_short(v)}' for k, v in fixed.items())}" if fixed else ""
    print(f"sweep of recipe {recipe.name!r}: {len(points)} points ({grid}; {seeds_reach(recipe, sweep)}); "
          f"stages {', '.join(order)}{shared}", flush=True)
    from flows.sweep import r1_sweep

    result = until_stopped(lambda: r1_sweep(recipe=args.recipe, grid=sweep.grid, seeds=sweep.seeds,
                                            seed_stages=sweep.seed_stages, stages=order, deployment=args.deployment,
                                            parallel=args.parallel, overrides=fixed or None),
                            "the same `r1 sweep` goes on with the point it stopped in")
    if result is None:
        return 130
    print(f"\nMLflow sweep run {result.run_id}: {len(points)} points, {len(result.ran)} run now, "
          f"{len(points) - len(result.ran)} finished before\n")
    print(result.table)
    print(f"\n  points : {result.files['points']}\n  summary: {result.files['summary']}")
    for plot in result.files["plots"]:
        print(f"  plot   : {plot}")
    print("\n" + links(result.run_id, list(result.points.values())))
    return 0


def links(sweep_run_id: str, point_runs: list[str]) -> str:
    """The MLflow UI's pages of a sweep: its run (the points nested under it) and the points compared."""
    from runtime import tracking, ui_links

    c = tracking.client()
    experiment = c.get_run(sweep_run_id).info.experiment_id
    pages = ui_links.ui_links({sweep_run_id: experiment, **{run_id: experiment for run_id in point_runs}})
    uri = tracking.tracking_uri()
    where = "" if uri.startswith(("http://", "https://")) else f" (serve it first: {ui_links.ui_command(uri)})"
    compared = ui_links.ui_links({run_id: experiment for run_id in point_runs}).get("compare", "-")
    return "\n".join([f"MLflow UI{where}:", f"  the sweep run (its points nested) : {pages[sweep_run_id]}",
                      f"  the points' pipeline runs compared : {compared}"])


def check_deployment(name: str) -> None:
    """The pipeline deployment the points will run as exists on the server, and a worker polls its pool."""
    import os

    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    from flows.checks import UsageError
    from flows.placement import prefect_client

    if not os.environ.get("PREFECT_API_URL"):
        raise UsageError(f"--deployment {name}: deployments live on a Prefect server; set PREFECT_API_URL "
                         "(`r1 up` starts one)")
    with prefect_client() as client:
        try:
            deployment = client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise UsageError(f"--deployment {name}: no such deployment on {os.environ['PREFECT_API_URL']}; the "
                             "pipeline's are r1_pipeline/local, /gpu, /placed and /ray (deployments/prefect.yaml)"
                             ) from None
        if client.read_flow(deployment.flow_id).name != "r1_pipeline":
            raise UsageError(f"--deployment {name}: a deployment of another flow; a sweep's points run the "
                             "pipeline (r1_pipeline/...)")
        pool = deployment.work_pool_name
        if not any(w.status == WorkerStatus.ONLINE for w in client.read_workers_for_work_pool(pool)):
            raise UsageError(f"--deployment {name}: no worker is polling its pool {pool!r}; start one "
                             f"(prefect worker start --pool {pool})")


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _short(value) -> str:
    from grpo.sweep import show

    return show(value)
