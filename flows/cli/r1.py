"""The `r1` command: run the recipe, or one stage of it, on the embedded default or on configured servers.

    r1 run [--recipe tiny] [--stages cold_start_sft,...] [--from-run <pipeline run id>] [--fresh]
           [--set reasoning_grpo.grpo.optimizer.learning_rate=2e-5 ...]   # any recipe field, checked like the recipe
    r1 stage cold_start_sft [--recipe tiny] [--set cold_start_sft.train.max_steps=50 ...]
    r1 stage reasoning_grpo --checkpoint runs:/<run id>/checkpoint
    r1 stage sft --dataset runs:/<run id>/dataset/curated [--heldout runs:/<run id>/dataset/heldout]
    r1 serve CHECKPOINT [--host 127.0.0.1] [--port 8000]   # an OpenAI-compatible API, e.g. for the judge
    r1 plan [--recipe tiny] [--tokens-per-s N]   # rejection sampling sized: prompts, samples, tokens, rows, time
    r1 where                      # where state, MLflow and Prefect live, and how to open their UIs
    r1 up [--prefect-port 4200] [--mlflow-port 5000]   # a local team stack: servers, a worker, every deployment
    r1 down                       # stop what `r1 up` started
    r1 deploy [--recipe R] [--pool P]   # each stage's deployment <stage>/<pool>, on the pool its section names
    r1 compare RUN_A RUN_B [...]  # pipeline runs (or a sweep's points) stage by stage: params that differ, metrics
    r1 show RUN                   # every figure of a pipeline run's stages (or of one stage run), and their URIs
    r1 sweep [--recipe R] --grid PATH=V1,V2 [--grid ...] [--seeds N] [--stages ...]   # a grid of pipeline runs
    r1 audit-rewards [--file ROWS.jsonl] [--judge URL]   # precision/recall of the rule, math-verify, rule + appeal

A mistake in what was asked for (recipe, data, model, run id, stage, endpoint, port, folder) is found before
anything starts and told in one line, exit code 2; --debug adds the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from contextlib import ExitStack

from grpo import startup
from grpo.configs.recipe import STAGES


def _where() -> str:
    from runtime import tracking, ui_links

    uri = tracking.tracking_uri()
    lines = [f"state folder : {tracking.r1_home()}", f"MLflow       : {uri}"]
    if uri.startswith("sqlite:"):
        lines.append(f"  browse it  : {ui_links.ui_command(uri)}   (then {ui_links.ui_base(uri)})")
    elif uri.startswith(("http://", "https://")):
        lines.append(f"  browse it  : {ui_links.ui_base(uri)}")
    api = os.environ.get("PREFECT_API_URL")
    home = os.environ.get('PREFECT_HOME', '~/.prefect')
    from flows.cli.credentials import credentials_path

    if credentials_path().exists():
        lines.append(f"logins       : {credentials_path()}   (`r1 up`'s stack; mode 0600)")
    lines.append(f"Prefect      : {api or 'temporary local API, database under ' + home}")
    if not api:  # the UI over this very database: `r1 up`'s server uses PREFECT_HOME, or a bare server on it
        prefect = ui_links.tool_command("prefect")
        lines.append(f"  browse it  : {ui_links.tool_command('r1')} up   (both UIs: http://127.0.0.1:4200 and "
                     f"{ui_links.ui_base(uri)}), or PREFECT_HOME={home} {prefect} server start")
    return "\n".join(lines)


def _print_links(runs: dict[str, str]) -> None:
    from runtime import ui_links

    print("\n" + ui_links.ui_text(runs))


def _log_requests() -> None:
    """One line per request on stderr: client, method, path, status (never headers, so never a key)."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log = logging.getLogger("flows.cli.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # the root logger's handlers (if any) would print it twice


def _serve(args: argparse.Namespace) -> int:
    """Load the checkpoint (fetching an MLflow URI first) and serve it until Ctrl-C."""
    from flows.checks import UsageError, check_uri, looks_like_a_path
    from flows.cli.preflight import check_port

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise UsageError(f"--api-key-env names ${args.api_key_env}, which is not set")
    check_port("--port", args.port, args.host)
    path = args.checkpoint
    if path.startswith("runs:/") or looks_like_a_path(path):  # else a hub name, "tiny" or a registry URI
        check_uri("CHECKPOINT", path)
    from flows.cli.serve import load_checkpoint, make_server, serve_until_interrupted

    if path.startswith(("runs:/", "models:/")):
        from mlflow.exceptions import MlflowException

        from runtime import tracking

        try:
            path = str(tracking.download(path))
        except (MlflowException, OSError) as e:
            raise UsageError(f"cannot fetch {args.checkpoint} from MLflow at {tracking.tracking_uri()}: {e}") from None
    startup.imports_done()
    try:
        model, tokenizer = load_checkpoint(path, dtype=args.dtype)
    except (OSError, ValueError) as e:  # a folder that holds no model
        raise UsageError(f"cannot load checkpoint {args.checkpoint!r}: {e}") from None
    try:
        from grpo.configs.sampling import GenerationConfig

        generation = GenerationConfig(sampler=args.sampler, kv_cache_mb=args.kv_cache_mb)
        server = make_server(model, tokenizer, args.host, args.port, model_name=args.model_name or args.checkpoint,
                             api_key=api_key, generation=generation, slots=args.slots,
                             max_waiting=args.max_waiting)
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    name = server.model_name
    _log_requests()
    print(f"serving {name!r} ({type(model).__name__} on {model.device}) at {server.url}", flush=True)
    print(f"  judge with: backend=http, base_url={server.url}, model={name!r}", flush=True)
    print(f"  sample with: generation.backend=http, endpoints=[{server.url}], model={name!r}   (Ctrl-C stops)",
          flush=True)
    serve_until_interrupted(server)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, also print its traceback")
    overrides = argparse.ArgumentParser(add_help=False)
    overrides.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                           help="override a recipe field by its dotted path, the value read as YAML "
                                "(e.g. reasoning_grpo.grpo.optimizer.learning_rate=2e-5); repeatable")
    overrides.add_argument("--promote", dest="overrides", action="append_const",
                           const="alignment_grpo.promotion=always",
                           help="move the registry alias to the new final model whatever its held-out accuracy")
    parser = argparse.ArgumentParser(prog="r1", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", parents=[common, overrides],
                         help="run the pipeline (all available stages, or --stages)")
    run.add_argument("--recipe", default="tiny", help="recipe name under recipes/ or a YAML path (default: tiny)")
    run.add_argument("--stages", default=None, help="comma-separated stage names to run (default: all five)")
    run.add_argument("--from-run", default=None, help="an earlier pipeline run (MLflow run id) whose URIs feed the "
                                                      "stages left out")
    run.add_argument("--fresh", action="store_true", help="start over: reuse no finished stage and resume from no "
                                                          "checkpoint (default: the same run again reuses and resumes)")
    stage = sub.add_parser("stage", parents=[common, overrides],
                           help="run one stage alone with its section of the recipe")
    stage.add_argument("name", help="stage name, e.g. cold_start_sft")
    stage.add_argument("--recipe", default="tiny")
    stage.add_argument("--checkpoint", default=None, help="the upstream checkpoint URI (runs:/<id>/checkpoint)")
    stage.add_argument("--dataset", default=None, help="sft: the curated dataset URI (runs:/<id>/dataset/curated)")
    stage.add_argument("--heldout", default=None, help="sft: held-out rows to evaluate on (runs:/<id>/dataset/heldout)")
    stage.add_argument("--input", dest="inputs", action="append", default=[], metavar="PARAM=URI",
                       help="any input the stage declares, by its flow parameter "
                            "(e.g. cold_start_dataset_uri=runs:/...)")
    serve = sub.add_parser("serve", parents=[common], help="serve a checkpoint as an OpenAI-compatible chat API")
    serve.add_argument("checkpoint", help="a checkpoint folder, runs:/<id>/checkpoint, models:/<name>/<version>, "
                                          "or tiny")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    serve.add_argument("--model-name", default=None, help="the model id clients send (default: CHECKPOINT as given)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    serve.add_argument("--sampler", default="auto", choices=["auto", "loop"],
                       help="auto: the paged-cache sampler for Qwen2/Llama-style models; loop: step-by-step decoding")
    serve.add_argument("--kv-cache-mb", type=_positive_int, default=None,
                       help="the K/V cache's page pool at most, in MiB (default: half the GPU's free memory; no "
                            "limit on a CPU)")
    serve.add_argument("--api-key-env", default=None,
                       help="NAME of an env var holding a key every request must send as a Bearer token")
    serve.add_argument("--slots", type=_positive_int, default=64,
                       help="rows decoded at once, across requests (default: 64; fewer where the KV budget holds fewer)")
    serve.add_argument("--max-waiting", type=_positive_int, default=256,
                       help="requests that may wait for a slot; one more is answered 429 (default: 256)")
    plan = sub.add_parser("plan", parents=[common], help="size a recipe's rejection sampling (prompts, samples, "
                                                         "shards, tokens, rows kept, time) without running it")
    plan.add_argument("--recipe", default="tiny")
    plan.add_argument("--tokens-per-s", type=float, default=None,
                      help="generation throughput per generator (default: the recipe's budget.tokens_per_s, else "
                           "measured by a short real generation)")
    plan.add_argument("--mean-fraction", type=float, default=None,
                      help="assumed mean completion length as a share of max_new_tokens (default: the recipe's "
                           "budget.mean_fraction, else measured with the throughput, else 0.5)")
    plan.add_argument("--keep-rate", type=float, default=None,
                      help="assumed share of samples that pass every check (default: the recipe's "
                           "budget.keep_rate, 0.5)")
    plan.add_argument("--generators", type=int, default=None,
                      help="servers or GPUs sampling at once (default: the recipe's budget.generators, else its "
                           "endpoints, or 1 locally)")
    plan.add_argument("--checkpoint", default=None, help="a model folder to measure with (default: the recipe's)")
    sub.add_parser("where", parents=[common], help="print where state, MLflow and Prefect live")
    up = sub.add_parser("up", parents=[common],
                        help="start a Prefect server, an MLflow server and a worker; deploy every flow")
    up.add_argument("--prefect-port", type=int, default=4200, help="Prefect server port; 0 picks a free one")
    up.add_argument("--mlflow-port", type=int, default=5000, help="MLflow server port; 0 picks a free one")
    sub.add_parser("down", parents=[common], help="stop the processes `r1 up` started")
    deploy = sub.add_parser("deploy", parents=[common, overrides],
                            help="make each stage's deployment <stage>/<pool> on the pool its recipe section names")
    deploy.add_argument("--recipe", default="tiny")
    deploy.add_argument("--pool", default=None, help="also deploy the stages that name no pool on this one")
    from flows.cli import sweep as sweep_command

    sweep_command.add_parser(sub, [common])
    compare = sub.add_parser("compare", parents=[common],
                             help="compare pipeline runs (MLflow parent run ids; a sweep run: its points) stage by "
                                  "stage")
    compare.add_argument("runs", nargs="+", metavar="RUN", help="two pipeline runs or more, or a sweep run")
    show = sub.add_parser("show", parents=[common], help="every figure a pipeline run's stages logged, stage by "
                                                         "stage, and the URIs they made (or one stage run's)")
    show.add_argument("run", metavar="RUN", help="a pipeline run (MLflow parent run id) or a stage run")
    from flows.cli import audit as audit_command

    audit_command.add_parser(sub, [common])
    return parser


def _is_user_error(e: BaseException) -> bool:
    """Errors a user causes and can fix (recipe, data, model, run id, endpoint, port, folder): one line, exit 2."""
    from flows.checks import UsageError
    from grpo.configs.recipe import RecipeError

    kinds: tuple[type, ...] = (UsageError, RecipeError)
    if "grpo.data.tables" in sys.modules:  # only loaded once data was read
        kinds += (sys.modules["grpo.data.tables"].DataError,)
    return isinstance(e, kinds)


def _fault(e: BaseException):
    """The `grpo.faults.Fault` that `e` is (or comes from), a full disk under the state folder included; else None."""
    from grpo.faults import disk_fault
    from runtime.env import home_path

    return disk_fault(e, [home_path()])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    startup.defer_collection()  # until the libraries are loaded (`until_stopped`, `_serve`): a sixth of their CPU
    try:
        try:
            return _dispatch(args)
        finally:
            startup.collection_back()
            if "flows.cli.local_api" in sys.modules:  # a local API started early that no run took (a check failed)
                sys.modules["flows.cli.local_api"].stop_early()
    except KeyboardInterrupt:  # before a run started (a run's own Ctrl-C is told in until_stopped)
        print("r1: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        fault = None if _is_user_error(e) else _fault(e)
        if fault is not None:  # the machine's or a store's fault (a full disk, a damaged file): one line, exit 1
            if getattr(args, "debug", False):
                traceback.print_exc()
            # on a line of its own: what else wrote to the terminal last (a progress bar, Prefect's "Error logging
            # to API" when its database shares the full disk) may have left no newline
            print("\nr1: " + " ".join(str(fault).split()), file=sys.stderr)
            return 1
        if not _is_user_error(e):
            raise
        if getattr(args, "debug", False):
            traceback.print_exc()
        print("r1: " + " ".join(str(e).split()), file=sys.stderr)  # one line, whatever the message held
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "audit-rewards":  # needs no state folder, server or stack: nothing of them loads
        from flows.cli import audit as audit_command

        return audit_command.run(args)
    from flows.cli import preflight
    from flows.cli.credentials import use_stack_credentials

    preflight.check_state_folder()
    warning = use_stack_credentials()  # the logins of the `r1 up` stack the environment names, before Prefect loads
    if warning:
        print("r1: " + warning, file=sys.stderr)
    import runtime  # noqa: F401  (embedded-default environment before Prefect loads)

    if args.command == "where":
        print(_where())
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command in ("up", "down"):
        from flows.cli import stack

        if args.command == "down":
            return stack.down()
        preflight.check_port("--prefect-port", args.prefect_port)
        preflight.check_port("--mlflow-port", args.mlflow_port)
        return stack.up(args.prefect_port, args.mlflow_port)
    if args.command == "sweep":
        from flows.cli import sweep as sweep_command

        return sweep_command.run(args, until_stopped)
    if args.command == "show":
        from flows.checks import check_run
        from flows.cli.compare import show

        preflight.check_servers()
        check_run("RUN", args.run)
        print(show(args.run))
        return 0
    if args.command == "compare":
        from mlflow.exceptions import MlflowException

        from flows.checks import check_run
        from flows.cli.compare import compare

        preflight.check_servers()
        for i, run_id in enumerate(args.runs):
            check_run(f"RUN {i + 1}", run_id)
        try:
            print(compare(*args.runs))
        except (MlflowException, ValueError) as e:
            raise preflight.UsageError(f"cannot compare {' and '.join(args.runs)}: {e}") from None
        return 0

    from grpo.configs.recipe import apply_overrides, load_recipe

    # everything that can be checked is checked here, before a server or a run starts
    from flows.cli.preflight import parse_overrides

    recipe = apply_overrides(load_recipe(args.recipe), parse_overrides(getattr(args, "overrides", [])))
    if args.command == "plan":
        from flows.cli.plan import plan_text

        try:
            # a figure given here wins over the recipe's `budget`, the assumptions its stage plans with
            budget = recipe.rejection_sampling.budget
            print(plan_text(recipe.rejection_sampling, checkpoint=args.checkpoint, **{
                name: budget_value if (flag := getattr(args, name)) is None else flag
                for name, budget_value in budget.model_dump().items()}))
        except (OSError, ValueError, RuntimeError) as e:  # a bad figure, a model or an endpoint out of reach
            raise preflight.UsageError(f"plan: {e}") from None
        return 0
    if args.command == "deploy":
        return _deploy(args, recipe)
    if args.command == "run":
        stages = preflight.check_stages([s.strip() for s in args.stages.split(",")] if args.stages else STAGES)
    else:
        stages = preflight.check_stages([args.name])
    print(_first_line(args, recipe, stages), flush=True)
    # the checks that load neither Prefect nor MLflow nor torch come first: a mistake in the recipe's data or models is
    # told within seconds, not after the libraries have loaded
    preflight.check_tracking_server()  # first: the recipe's runs:/ URIs are looked up on the tracking server
    preflight.check_recipe(recipe, stages)
    preflight.check_precision(recipe, stages)
    from flows.cli.local_api import start_early
    from flows.cli.waiting import saying

    with saying("loading Prefect, MLflow, torch and transformers"):
        start_early()  # the local Prefect API comes up while the checks below load the stages' libraries
        preflight.check_prefect_server()
        if args.command == "run":
            from flows.placement import check_placement

            check_placement(recipe, stages)  # stages placed on pools: pools, workers and deployments are there
        preflight.check_distributed(recipe, stages)
        if args.command == "run":
            from flows.r1_pipeline import r1_pipeline  # noqa: F401  (the stages' libraries, loaded here)
        else:
            from flows.stages import declared  # noqa: F401
    return _run(args, recipe, stages) if args.command == "run" else _stage(args, recipe)


def _first_line(args: argparse.Namespace, recipe, stages: list[str]) -> str:
    """What `r1 run` or `r1 stage` will run and where its runs go, said before any check or library loads (a second
    or so), so a person sees at once what the command understood."""
    from runtime.env import home_path, tracking_uri

    named = recipe.name if args.recipe == recipe.name else f"{recipe.name} ({args.recipe})"
    what = f"stages {', '.join(stages)}" if args.command == "run" else f"stage {stages[0]} alone"
    if getattr(args, "from_run", None):
        what += f", the others' outputs from pipeline run {args.from_run}"
    return f"recipe {named}, {what}; runs tracked in MLflow at {tracking_uri()}, state folder {home_path()}"


def _run(args: argparse.Namespace, recipe, stages: list[str]) -> int:
    from flows.cli import preflight

    uris = preflight.check_from_run(args.from_run) if args.from_run else {}
    from flows.stages import missing_inputs

    missing = missing_inputs(stages, uris)
    if missing:
        raise preflight.UsageError("missing inputs: " + ", ".join(f"{s} needs {u}" for s, u in missing) +
                                   "; add the stage that makes them to --stages, or give --from-run <pipeline run id>")
    from flows.r1_pipeline import r1_pipeline

    result = until_stopped(lambda: r1_pipeline(recipe=args.recipe, stages=stages if args.stages else None,
                                                from_run=args.from_run, fresh=args.fresh,
                                                overrides=preflight.parse_overrides(args.overrides) or None),
                            "the same `r1 run` resumes where it stopped (--fresh starts over)")
    if result is None:
        return 130
    from flows.cli.summary import table

    print(f"\nMLflow pipeline run {result.run_id} (recipe {recipe.name}):")
    print(table(result.stages, result.run_id))
    _print_links({"pipeline run": result.run_id})
    print("\n" + _where())
    return 0


def until_stopped(run, resumes: str):
    """`run()` on the local Prefect API (unless a server is configured), stopped cleanly by Ctrl-C or SIGTERM (to this
    process or its whole group): its MLflow runs end KILLED, its flow run Crashed, and None is returned."""
    from flows.cli.local_api import local_prefect_api
    from flows.cli.waiting import saying
    from grpo.interrupts import is_interrupt, stop_on_signals

    startup.imports_done()  # the stages' libraries are loaded: nothing of the run is made yet
    # what was asked for is checked; say so before the silent part (the local API, the stores, a stage's imports)
    where = os.environ.get("PREFECT_API_URL") or "Prefect's local API"
    # (not "r1: ...": that prefix is kept for the one line a fault or a stop ends with)
    try:
        with stop_on_signals(), ExitStack() as api:
            with saying(f"checked; starting on {where} (the first progress bar may take half a minute on a new "
                        "home)"):
                api.enter_context(local_prefect_api())  # waits for the local API to answer
            return run()
    except BaseException as e:
        if not is_interrupt(e):
            raise
    print(f"r1: interrupted; its MLflow runs are marked KILLED, and {resumes}", file=sys.stderr)
    return None


def _deploy(args: argparse.Namespace, recipe) -> int:
    from flows.checks import UsageError
    from flows.cli import preflight
    from flows.cli.deploy import deploy_stages, stage_pools

    if not os.environ.get("PREFECT_API_URL"):
        raise UsageError("deploy: deployments live on a Prefect server; set PREFECT_API_URL (`r1 up` starts one)")
    preflight.check_servers()
    if not stage_pools(recipe, args.pool):
        raise UsageError(f"deploy: recipe {recipe.name!r} places no stage on a pool (resources.pool); name one "
                         "with --pool to deploy every stage there")
    for name in deploy_stages(recipe, args.pool):
        print(f"deployed {name}")
    return 0


def _input_flag(param: str) -> str:
    """How `r1 stage` is given an input: its own flag, or --input PARAM=URI."""
    flag = param.removesuffix("_uri")
    own = flag in ("checkpoint", "dataset", "heldout")
    return f"--{flag} runs:/<run id>/..." if own else f"--input {param}=runs:/<run id>/..."


def _stage(args: argparse.Namespace, recipe) -> int:
    from flows.checks import UsageError, check_uri
    from flows.stages import declared

    stage = declared()[args.name]
    given = {"checkpoint_uri": args.checkpoint, "dataset_uri": args.dataset, "heldout_uri": args.heldout}
    for item in args.inputs:
        param, sep, uri = item.partition("=")
        if not sep or param not in stage.inputs:
            raise UsageError(f"--input {item!r}: expected PARAM=URI with PARAM one of {list(stage.inputs)}")
        given[param] = uri
    kwargs = {p: given[p] for p in stage.inputs if given.get(p)}
    config = getattr(recipe, args.name)
    needed = [p for p, uri in stage.inputs.items() if uri in stage.needs(config)]
    if any(p not in kwargs for p in needed):
        flags = " ".join(_input_flag(p) for p in needed if p not in kwargs)
        asked = [f"{args.name}.{stage.needed_when[uri]} is set" for p, uri in stage.inputs.items()
                 if p in needed and p not in kwargs and uri in stage.needed_when]
        raise UsageError(f"stage {args.name} needs {flags}" + (f" ({'; '.join(asked)})" if asked else ""))
    for param, uri in kwargs.items():
        check_uri(f"--{param.removesuffix('_uri')}", uri)
    stage_flow = stage.flow.with_options(flow_run_name=lambda: f"{args.name}:{recipe.name}")
    result = until_stopped(lambda: stage_flow(config=getattr(recipe, args.name), **kwargs),
                            "the same `r1 stage` resumes from its last checkpoint")
    if result is None:
        return 130
    from flows.cli.summary import table

    print()
    print(table({args.name: result}, result.run_id))
    _print_links({"stage run": result.run_id})
    print("\n" + _where())
    return 0


if __name__ == "__main__":
    sys.exit(main())
