"""The `r1` command: run the recipe, or one stage of it, on the embedded default or on configured servers.

    r1 run [--recipe tiny] [--stages cold_start_sft,...]
    r1 stage cold_start_sft [--recipe tiny]
    r1 stage reasoning_grpo --checkpoint runs:/<run id>/checkpoint
    r1 where                      # where state, MLflow and Prefect live, and how to open their UIs
"""

from __future__ import annotations

import argparse
import os
import sys


def _where() -> str:
    from tasks import tracking

    uri = tracking.tracking_uri()
    lines = [f"state folder : {tracking.r1_home()}", f"MLflow       : {uri}"]
    if uri.startswith("sqlite:"):
        lines.append(f"  browse it  : mlflow ui --backend-store-uri {uri} --port 5000   (then http://127.0.0.1:5000)")
    api = os.environ.get("PREFECT_API_URL")
    home = os.environ.get('PREFECT_HOME', '~/.prefect')
    lines.append(f"Prefect      : {api or 'temporary local API, database under ' + home}")
    if not api:
        lines.append("  browse it  : prefect server start   (then http://127.0.0.1:4200)")
    return "\n".join(lines)


def _print_stage(name: str, result) -> None:
    metrics = ", ".join(f"{k}={v:.3f}" for k, v in sorted(result.metrics.items()))
    print(f"  {name:<20} run {result.run_id}  {metrics}")
    for key, uri in result.uris.items():
        print(f"  {'':<20} {key}: {uri}")


def main(argv: list[str] | None = None) -> int:
    import tasks  # noqa: F401  (embedded-default environment before Prefect loads)

    parser = argparse.ArgumentParser(prog="r1", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline (all available stages, or --stages)")
    run.add_argument("--recipe", default="tiny", help="recipe name under recipes/ or a YAML path (default: tiny)")
    run.add_argument("--stages", default=None, help="comma-separated stage names to run (default: all available)")
    stage = sub.add_parser("stage", help="run one stage alone with its section of the recipe")
    stage.add_argument("name", help="stage name, e.g. cold_start_sft")
    stage.add_argument("--recipe", default="tiny")
    stage.add_argument("--checkpoint", default=None, help="the upstream checkpoint URI (runs:/<id>/checkpoint)")
    sub.add_parser("where", help="print where state, MLflow and Prefect live")
    args = parser.parse_args(argv)

    if args.command == "where":
        print(_where())
        return 0

    from grpo.config import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as e:
        print(f"r1: {e}", file=sys.stderr)
        return 2

    if args.command == "run":
        from flows.r1_pipeline import r1_pipeline

        stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
        result = r1_pipeline(recipe=args.recipe, stages=stages)
        print(f"\nMLflow pipeline run {result.run_id} (recipe {recipe.name}):")
        for name, r in result.stages.items():
            _print_stage(name, r)
    else:
        from flows import stages as stage_flows

        if args.name not in stage_flows.FLOWS:
            print(f"r1: unknown stage {args.name!r}; available: {sorted(stage_flows.FLOWS)}", file=sys.stderr)
            return 2
        config = getattr(recipe, args.name)
        if args.name in stage_flows.NEEDS_CHECKPOINT:
            if not args.checkpoint:
                print(f"r1: stage {args.name} needs --checkpoint runs:/<run id>/checkpoint", file=sys.stderr)
                return 2
            result = stage_flows.FLOWS[args.name](args.checkpoint, config)
        else:
            result = stage_flows.FLOWS[args.name](config)
        print()
        _print_stage(args.name, result)
    print("\n" + _where())
    return 0


if __name__ == "__main__":
    sys.exit(main())
