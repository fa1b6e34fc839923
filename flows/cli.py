"""The `r1` command: run the recipe, or one stage of it, on the embedded default or on configured servers.

    r1 run [--recipe tiny] [--stages cold_start_sft,...] [--from-run <pipeline run id>]
    r1 stage cold_start_sft [--recipe tiny]
    r1 stage reasoning_grpo --checkpoint runs:/<run id>/checkpoint
    r1 stage sft --dataset runs:/<run id>/dataset/curated [--heldout runs:/<run id>/dataset/heldout]
    r1 serve CHECKPOINT [--host 127.0.0.1] [--port 8000]   # an OpenAI-compatible API, e.g. for the judge
    r1 where                      # where state, MLflow and Prefect live, and how to open their UIs
    r1 up [--prefect-port 4200] [--mlflow-port 5000]   # a local team stack: servers, a worker, every deployment
    r1 down                       # stop what `r1 up` started
    r1 compare RUN_A RUN_B        # two pipeline runs stage by stage: params that differ, metrics side by side
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
    if name == "rejection_sampling":  # dozens of counters, most of them zero: what was kept, and why the rest went
        from grpo.rejection.filters import summary_line

        metrics = summary_line(result.metrics)
    else:
        metrics = ", ".join(f"{k}={v:.3f}" for k, v in sorted(result.metrics.items()))
    print(f"  {name:<20} run {result.run_id}  {metrics}")
    for key, uri in result.uris.items():
        print(f"  {'':<20} {key}: {uri}")


def _log_requests() -> None:
    """One line per request on stderr: client, method, path, status (never headers, so never a key)."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log = logging.getLogger("grpo.sampling.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the root logger's handlers (if any) would print it twice


def _serve(args: argparse.Namespace) -> int:
    """Load the checkpoint (fetching an MLflow URI first) and serve it until Ctrl-C."""
    from grpo.sampling.serve import load_checkpoint, make_server, serve_until_interrupted

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(f"r1: --api-key-env names ${args.api_key_env}, which is not set", file=sys.stderr)
            return 2
    if not 0 <= args.port <= 65535:
        print(f"r1: --port must be in 0..65535 (0 picks a free port), got {args.port}", file=sys.stderr)
        return 2
    path = args.checkpoint
    if path.startswith(("runs:/", "models:/")):
        from mlflow.exceptions import MlflowException

        from tasks import tracking

        try:
            path = str(tracking.download(path))
        except (MlflowException, OSError) as e:
            print(f"r1: cannot fetch {args.checkpoint} from MLflow at {tracking.tracking_uri()}: {e}",
                  file=sys.stderr)
            return 2
    try:
        model, tokenizer = load_checkpoint(path, dtype=args.dtype)
    except (OSError, ValueError) as e:  # a missing or non-model folder, a bad dtype
        print(f"r1: cannot load checkpoint {args.checkpoint!r}: {e}", file=sys.stderr)
        return 2
    try:
        server = make_server(model, tokenizer, args.host, args.port, model_name=args.model_name or args.checkpoint,
                             api_key=api_key)
    except OSError as e:
        print(f"r1: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    name = server.model_name
    _log_requests()
    print(f"serving {name!r} ({type(model).__name__} on {model.device}) at {server.url}", flush=True)
    print(f"  judge with: backend=http, base_url={server.url}, model={name!r}   (Ctrl-C stops)", flush=True)
    serve_until_interrupted(server)
    return 0


def main(argv: list[str] | None = None) -> int:
    import tasks  # noqa: F401  (embedded-default environment before Prefect loads)

    parser = argparse.ArgumentParser(prog="r1", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline (all available stages, or --stages)")
    run.add_argument("--recipe", default="tiny", help="recipe name under recipes/ or a YAML path (default: tiny)")
    run.add_argument("--stages", default=None, help="comma-separated stage names to run (default: all five)")
    run.add_argument("--from-run", default=None, help="an earlier pipeline run (MLflow run id) whose URIs feed the "
                                                      "stages left out")
    stage = sub.add_parser("stage", help="run one stage alone with its section of the recipe")
    stage.add_argument("name", help="stage name, e.g. cold_start_sft")
    stage.add_argument("--recipe", default="tiny")
    stage.add_argument("--checkpoint", default=None, help="the upstream checkpoint URI (runs:/<id>/checkpoint)")
    stage.add_argument("--dataset", default=None, help="sft: the curated dataset URI (runs:/<id>/dataset/curated)")
    stage.add_argument("--heldout", default=None, help="sft: held-out rows to evaluate on (runs:/<id>/dataset/heldout)")
    serve = sub.add_parser("serve", help="serve a checkpoint as an OpenAI-compatible chat API")
    serve.add_argument("checkpoint", help="a checkpoint folder, runs:/<id>/checkpoint, models:/<name>/<version>, "
                                          "or tiny")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    serve.add_argument("--model-name", default=None, help="the model id clients send (default: CHECKPOINT as given)")
    serve.add_argument("--dtype", default="float32", help="weights dtype: float32, bfloat16 or float16")
    serve.add_argument("--api-key-env", default=None,
                       help="NAME of an env var holding a key every request must send as a Bearer token")
    sub.add_parser("where", help="print where state, MLflow and Prefect live")
    up = sub.add_parser("up", help="start a Prefect server, an MLflow server and a worker; deploy every flow")
    up.add_argument("--prefect-port", type=int, default=4200, help="Prefect server port; 0 picks a free one")
    up.add_argument("--mlflow-port", type=int, default=5000, help="MLflow server port; 0 picks a free one")
    sub.add_parser("down", help="stop the processes `r1 up` started")
    compare = sub.add_parser("compare", help="compare two pipeline runs (MLflow parent run ids) stage by stage")
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    args = parser.parse_args(argv)

    if args.command == "where":
        print(_where())
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command in ("up", "down"):
        from flows import stack

        return stack.up(args.prefect_port, args.mlflow_port) if args.command == "up" else stack.down()
    if args.command == "compare":
        from mlflow.exceptions import MlflowException

        from flows.compare import compare

        try:
            print(compare(args.run_a, args.run_b))
        except (MlflowException, ValueError) as e:
            print(f"r1: cannot compare {args.run_a} and {args.run_b}: {e}", file=sys.stderr)
            return 2
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
        result = r1_pipeline(recipe=args.recipe, stages=stages, from_run=args.from_run)
        print(f"\nMLflow pipeline run {result.run_id} (recipe {recipe.name}):")
        for name, r in result.stages.items():
            _print_stage(name, r)
    else:
        from flows import stages as stage_flows

        if args.name not in stage_flows.FLOWS:
            print(f"r1: unknown stage {args.name!r}; available: {sorted(stage_flows.FLOWS)}", file=sys.stderr)
            return 2
        config = getattr(recipe, args.name)
        given = {"checkpoint_uri": args.checkpoint, "dataset_uri": args.dataset, "heldout_uri": args.heldout}
        kwargs = {p: given[p] for p in stage_flows.INPUTS[args.name] if given.get(p)}
        needed = [p for p, uri in stage_flows.INPUTS[args.name].items() if uri not in stage_flows.OPTIONAL]
        if any(p not in kwargs for p in needed):
            flags = " ".join(f"--{p.removesuffix('_uri')} runs:/<run id>/..." for p in needed)
            print(f"r1: stage {args.name} needs {flags}", file=sys.stderr)
            return 2
        result = stage_flows.FLOWS[args.name](config=config, **kwargs)
        print()
        _print_stage(args.name, result)
    print("\n" + _where())
    return 0


if __name__ == "__main__":
    sys.exit(main())
