"""What `r1` checks before it starts anything: one clear error, before the Prefect server or any MLflow run.

The recipe's own settings are checked when it is read (`grpo.configs`: types, ranges, names, fields that must
agree). Here come the checks that look beyond the recipe, reading files but loading no model and training nothing:

- the data the selected stages read: read and validated as the stage will, and enough prompts for a GRPO step;
- model folders: there, with a config.json whose context fits the recipe's token budgets;
- the sandbox, wherever a stage will run programs: the code reward, and rows or held-out rows with tests (any
  stage that evaluates them, SFT included, and rejection sampling's rule check);
- the precision each training loop asks for, on this machine (fp16 needs a GPU);
- the state folder, the MLflow and Prefect servers the environment names (that they answer, and take the
  credentials the environment sends), an HTTP judge the recipe names;
- run ids and `runs:/` URIs given on the command line, and ports.

Each failure is a `UsageError` naming what is wrong and what was expected; the CLI prints it as one line.
"""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from typing import Sequence

from flows.checks import UsageError, check_model_folder, check_run
from grpo.configs.checks import check_fits_context
from grpo.configs.model import TINY
from grpo.configs.recipe import STAGES, Recipe


def check_stages(names: Sequence[str]) -> list[str]:
    """The stage names in the recipe's order; an unknown one fails, listing the known ones."""
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise UsageError(f"unknown stage(s) {unknown}; the stages are {list(STAGES)}")
    return [s for s in STAGES if s in names]


# ----------------------------------------------------------------------------------------------------------------
# The recipe against its data and models


def check_recipe(recipe: Recipe, stages: Sequence[str]) -> None:
    """Data and model checks for the stages that will run (the recipe's settings were checked when it was read).
    Light: no Prefect, and no MLflow or torch unless the recipe names a `runs:/` URI or an HTTP judge."""
    from flows.stage_checks import preflight

    for stage in stages:
        preflight(stage).check(getattr(recipe, stage))
    _check_models(recipe, stages)


def _check_models(recipe: Recipe, stages: Sequence[str]) -> None:
    """The models the selected stages load by name, and their context against the recipe's token budgets."""
    from flows.stage_checks import preflight

    contexts: dict[str, int] = {}
    for stage in stages:
        for field, model in preflight(stage).loads(getattr(recipe, stage)):
            folder = _local_folder(field, model)
            config = check_model_folder(field, folder) if folder != TINY else None
            if config and "max_position_embeddings" in config:
                contexts[model.name_or_path] = int(config["max_position_embeddings"])
    for field, tokens, model, plus_prompt in recipe.token_budgets():
        if field.split(".")[0] in stages and model.name_or_path in contexts:
            try:
                check_fits_context(field, tokens, contexts[model.name_or_path], plus_prompt)
            except ValueError as e:
                raise UsageError(f"{e} ({model.name_or_path})") from None


def _local_folder(field: str, model) -> str:
    """The folder (or hub name, or tiny) a stage's model loads from: a GGUF, on disk or in a package, is found here
    and dequantized once into the model cache (a line says so), so a missing package or file, or a file transformers
    cannot read, fails before any stage starts."""
    from grpo.model_files import ModelFileError, local_model

    try:
        return local_model(model, say=lambda line: print(line, flush=True)).name_or_path
    except ModelFileError as e:
        raise UsageError(f"{field.removesuffix('.name_or_path')}: {e}") from None


def check_precision(recipe: Recipe, stages: Sequence[str]) -> None:
    """`R1_CPU_BF16` reads, and every training loop's mixed_precision resolves on this machine (only fp16 can fail:
    it needs a GPU). The loops are found in the stages' configs, wherever they keep one."""
    from grpo.training.precision import cpu_bf16_override, precision_fields

    try:
        cpu_bf16_override()
    except ValueError as e:
        raise UsageError(str(e)) from None
    wanted = [(f"{stage}.{path}", asked) for stage in stages
              for path, asked in precision_fields(getattr(recipe, stage)).items() if asked == "fp16"]
    if not wanted:
        return
    from grpo.training.precision import choose_precision  # reads the hardware (imports torch): only when it matters

    for where, precision in wanted:
        try:
            choose_precision(precision)
        except ValueError as e:
            raise UsageError(f"{where.removesuffix('mixed_precision')}{e}") from None


def check_distributed(recipe: Recipe, stages: Sequence[str]) -> None:
    """Each training stage's `distributed` setting can run here: its accelerate config file exists, the machine has
    a GPU per process (on a GPU machine), and "auto" splits the stage's global batches evenly."""
    for stage in stages:
        config = getattr(recipe, stage)
        cfg = getattr(config, "distributed", None)
        if cfg is None or (cfg.num_processes == 1 and cfg.num_machines == 1 and cfg.config_file is None):
            continue
        from grpo.training.launchers import launch  # reads the GPUs (imports torch): only when a stage asks for processes

        try:
            config.check_splits(launch.num_processes(cfg))
            if cfg.config_file:
                launch.config_file_path(cfg.config_file)
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(f"{stage}: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# The machine and the services around it


def check_state_folder() -> None:
    """R1_HOME (or the default .r1/) is a folder this user can write, or can be made."""
    from runtime.env import home_path

    home = home_path()
    what = f"R1_HOME={home}" if os.environ.get("R1_HOME") else f"the state folder {home}"
    if home.exists() and not home.is_dir():
        raise UsageError(f"{what} is a file; expected a folder for Prefect's and MLflow's state")
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{what}: cannot make the folder ({e.strerror}); point R1_HOME at a writable folder") from None
    if not os.access(home, os.W_OK | os.X_OK):
        raise UsageError(f"{what} is not writable; point R1_HOME at a writable folder")


def _answers(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> str | None:
    """None if `url` answers 200, else why not."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as reply:
            return None if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def check_servers() -> None:
    """The MLflow and Prefect servers the environment names answer (the embedded default has none to check)."""
    check_tracking_server()
    check_prefect_server()


def check_tracking_server() -> None:
    """The MLflow server MLFLOW_TRACKING_URI names answers and takes this process's login (plain HTTP: no MLflow)."""
    mlflow_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if mlflow_uri.startswith(("http://", "https://")):
        why = _answers(mlflow_uri.rstrip("/") + "/health")
        if why:
            raise UsageError(f"MLFLOW_TRACKING_URI={mlflow_uri}: no MLflow server answers ({why}); start it, "
                             "or unset the variable to track under R1_HOME")
        _check_mlflow_login(mlflow_uri)
    elif mlflow_uri and not mlflow_uri.startswith(("sqlite:", "postgresql", "mysql", "mssql", "databricks")):
        raise UsageError(f"MLFLOW_TRACKING_URI={mlflow_uri}: expected an http(s):// server or a database URI "
                         "such as sqlite:///path/mlflow.db")


def check_prefect_server() -> None:
    """The Prefect server PREFECT_API_URL names answers and takes this process's login (which imports Prefect)."""
    prefect_api = os.environ.get("PREFECT_API_URL", "")
    if prefect_api:
        why = _answers(prefect_api.rstrip("/") + "/health")
        if why:
            raise UsageError(f"PREFECT_API_URL={prefect_api}: no Prefect server answers ({why}); start it "
                             "(`r1 up` or `prefect server start`), or unset the variable for a temporary one")
        _check_prefect_login(prefect_api)


def _basic(user: str, password: str) -> dict[str, str]:
    import base64

    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


KEPT = "(`r1 up` keeps its stack's in <R1_HOME>/auth/credentials.env)"


def _check_prefect_login(api: str) -> None:
    """The Prefect server takes the credential this process sends (PREFECT_API_AUTH_STRING, from the environment
    or the Prefect profile): one line naming the setting, never the credential. (Prefect Cloud's PREFECT_API_KEY
    is Prefect's own to check.)"""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY

    auth = PREFECT_API_AUTH_STRING.value()
    if not auth and PREFECT_API_KEY.value():
        return
    why = _answers(api.rstrip("/") + "/admin/version", headers=_basic(*auth.partition(":")[::2]) if auth else {})
    if why == "HTTP 401":
        if auth:
            raise UsageError(f"PREFECT_API_URL={api}: the Prefect server refused PREFECT_API_AUTH_STRING ({why}); "
                             f"set it to the server's user:password {KEPT}")
        raise UsageError(f"PREFECT_API_URL={api}: the Prefect server asks for a login ({why}) and "
                         f"PREFECT_API_AUTH_STRING is not set; set it to the server's user:password {KEPT}")


def _check_mlflow_login(uri: str) -> None:
    """The MLflow server takes the login this process sends (MLFLOW_TRACKING_USERNAME and _PASSWORD, or
    MLFLOW_TRACKING_TOKEN): one line naming the setting, never the password."""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    headers = _basic(user, password or "") if user else {"Authorization": f"Bearer {token}"} if token else {}
    why = _answers(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1", headers=headers)
    if why == "HTTP 401":
        if user:
            raise UsageError(f"MLFLOW_TRACKING_URI={uri}: the MLflow server refused the login of "
                             f"MLFLOW_TRACKING_USERNAME={user} ({why}); set MLFLOW_TRACKING_PASSWORD to that user's "
                             f"password {KEPT}")
        if token:
            raise UsageError(f"MLFLOW_TRACKING_URI={uri}: the MLflow server refused MLFLOW_TRACKING_TOKEN ({why}); "
                             f"set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD instead {KEPT}")
        raise UsageError(f"MLFLOW_TRACKING_URI={uri}: the MLflow server asks for a login ({why}) and "
                         f"MLFLOW_TRACKING_USERNAME is not set; set it and MLFLOW_TRACKING_PASSWORD {KEPT}")
    if why == "HTTP 403":
        raise UsageError(f"MLFLOW_TRACKING_URI={uri}: MLflow user {user} may not read experiments ({why}); ask the "
                         "server's admin for a permission (READ at least, EDIT to run stages)")


def check_port(flag: str, port: int, host: str = "127.0.0.1") -> None:
    """`port` is a port number and free on `host` (0 picks a free one)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"{flag} must be in 0..65535 (0 picks a free port), got {port}")
    if port == 0:
        return
    with socket.socket() as s:
        # as the servers bind (uvicorn, http.server): a port whose last connections wait out TIME_WAIT is free to
        # them, and only a socket listening there is in the way
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror}); pick another port "
                             "(0 picks a free one)") from None


# ----------------------------------------------------------------------------------------------------------------
# Runs and URIs in MLflow


def check_from_run(run_id: str) -> dict[str, str]:
    """The URIs a pipeline run recorded; fails if there is no such run or it is not a pipeline run."""
    run = check_run("--from-run", run_id)
    uris = {k[len("uri."):]: v for k, v in run.data.tags.items() if k.startswith("uri.")}
    if not uris:
        raise UsageError(f"--from-run {run_id}: the run records no stage URIs (uri.* tags); expected a pipeline "
                         f"run (the parent run `r1 run` prints), got {run.data.tags.get('mlflow.runName', 'a run')!r}")
    return uris


def parse_overrides(given: list[str]) -> dict:
    """`--set PATH=VALUE` flags as {path: value}, each value read as YAML (50 a number, true a bool, [a, b] a list).

    YAML reads 2e-5 (no dot) as a string; the recipe's number fields take numeric strings, so it still works.
    """
    import yaml

    from flows.checks import UsageError

    overrides = {}
    for item in given:
        path, sep, text = item.partition("=")
        if not sep or not path.strip():
            raise UsageError(f"--set {item!r}: expected PATH=VALUE, such as "
                             f"reasoning_grpo.grpo.optimizer.learning_rate=2e-5")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or e
            raise UsageError(f"--set {item!r}: the value is not valid YAML: {problem}") from None
        overrides[path.strip()] = value
    return overrides
