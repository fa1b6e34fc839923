"""What `r1` checks before it starts anything: one clear error, before the Prefect server or any MLflow run.

The recipe's own settings are checked when it is read (`grpo.config`: types, ranges, names, fields that must
agree). Here come the checks that look beyond the recipe, reading files but loading no model and training nothing:

- the data the selected stages read: read and validated as the stage will, and enough prompts for a GRPO step;
- model folders: there, with a config.json whose context fits the recipe's token budgets;
- the sandbox, wherever a stage will run programs: the code reward, and rows or held-out rows with tests (any
  stage that evaluates them, SFT included, and rejection sampling's rule check);
- the precision each training loop asks for, on this machine (fp16 needs a GPU);
- the state folder, the MLflow and Prefect servers the environment names, an HTTP judge the recipe names;
- run ids and `runs:/` URIs given on the command line, and ports.

Each failure is a `UsageError` naming what is wrong and what was expected; the CLI prints it as one line.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from grpo.checks import check_fits_context, check_prompts_per_step
from grpo.config import SELF_JUDGE, TINY
from grpo.recipe import STAGES, Recipe


class UsageError(ValueError):
    """A mistake in what was asked for (recipe, data, model, run id, endpoint, port, folder): one line, exit 2."""


def check_stages(names: Sequence[str]) -> list[str]:
    """The stage names in the recipe's order; an unknown one fails, listing the known ones."""
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise UsageError(f"unknown stage(s) {unknown}; the stages are {list(STAGES)}")
    return [s for s in STAGES if s in names]


# ----------------------------------------------------------------------------------------------------------------
# The recipe against its data and models


def check_recipe(recipe: Recipe, stages: Sequence[str]) -> None:
    """Data and model checks for the stages that will run (the recipe's settings were checked when it was read)."""
    for stage in stages:
        CHECKS[stage](getattr(recipe, stage))
    _check_models(recipe, stages)


@contextmanager
def _reading(field: str) -> Iterator[None]:
    """A dataset that cannot be used, or a synthetic task that cannot make the rows asked for, named by field."""
    from grpo.data.tables import DataError

    try:
        yield
    except UsageError:
        raise
    except (DataError, ValueError) as e:
        raise UsageError(f"{field}: {e}") from None


def _has_tests(rows) -> bool:
    """Whether some of `rows` are code rows, judged by running their tests (in the sandbox, wherever they are)."""
    return rows is not None and bool({"tests", "io_tests"} & set(rows.columns))


def _check_sandbox(field: str, code=None) -> None:
    """Programs can run sandboxed here under `code` (a CodeConfig; the defaults evaluation uses when None): checked
    before any training, since the first program would otherwise fail the stage after it has trained."""
    from grpo.config import CodeConfig
    from grpo.rewards import SandboxUnavailable
    from grpo.rewards.code import code_limits
    from grpo.rewards.sandbox import check_sandbox

    try:
        check_sandbox(code_limits((code or CodeConfig()).model_dump()))
    except SandboxUnavailable as e:
        raise UsageError(f"{field}: {e}") from None


def _check_cold_start(cfg) -> None:
    from grpo.data.tables import load_sft_data

    with _reading("cold_start_sft.data"):
        _, heldout = load_sft_data(cfg.data)
    if _has_tests(heldout):  # evaluated after training, under the default limits (an SFT stage has no code section)
        _check_sandbox("cold_start_sft.data.heldout_source")


def _check_rewards(stage: str, grpo, train, heldout=None) -> None:
    """The rewards' columns in the rows, and for the code reward (or held-out rows that evaluation checks by their
    tests) a sandbox that works on this machine."""
    from grpo.rewards import check_reward_columns

    with _reading(f"{stage}.data"):
        check_reward_columns(grpo.rewards, train.columns, "its rows")
    if "code" in grpo.rewards or _has_tests(heldout):
        field = "grpo.rewards" if "code" in grpo.rewards else "data.heldout_source"
        _check_sandbox(f"{stage}.{field}", grpo.code)


def _check_reasoning(cfg) -> None:
    from grpo.data.tables import load_rl_data

    with _reading("reasoning_grpo.data"):
        train, heldout = load_rl_data(cfg.data)
    _check_rewards("reasoning_grpo", cfg.grpo, train, heldout)
    with _reading("reasoning_grpo"):
        cfg.check_prompts(len(train), cfg.data.source)
    if cfg.grpo.prm_path is not None:  # the process reward model that checks the steps
        if cfg.grpo.prm_path.startswith("runs:/"):
            check_uri("reasoning_grpo.grpo.prm_path", cfg.grpo.prm_path)
        else:
            _check_model_folder("reasoning_grpo.grpo.prm_path", cfg.grpo.prm_path)


def _check_rejection(cfg) -> None:
    from grpo.data.tables import load_rl_data, read_table, validate_rows

    with _reading("rejection_sampling.data"):
        train, heldout = load_rl_data(cfg.data)
    rs = cfg.rejection
    # its rule check runs the training rows' tests; its held-out rows are the ones the SFT stage evaluates later
    if _has_tests(train):
        _check_sandbox("rejection_sampling.data", rs.code)
    elif _has_tests(heldout):
        _check_sandbox("rejection_sampling.data.heldout_source")
    if rs.non_reasoning_rows and cfg.non_reasoning_source != "synthetic":
        with _reading("rejection_sampling.non_reasoning_source"):
            rows = validate_rows(read_table(cfg.non_reasoning_source),
                                 {"prompt": "text or chat messages", "response": "text"}, cfg.non_reasoning_source)
        if len(rows) < rs.non_reasoning_rows:
            raise UsageError(f"rejection_sampling.non_reasoning_source: {cfg.non_reasoning_source} has {len(rows)} "
                             f"rows; rejection.non_reasoning_rows asks for {rs.non_reasoning_rows}")
    judge = cfg.judge
    if judge is not None and rs.judge_when != "never":
        if judge.backend == "http":
            check_judge_endpoint(judge)
        elif judge.model not in (SELF_JUDGE, TINY):
            _check_model_folder("rejection_sampling.judge.model", judge.model)


def _check_sft(cfg) -> None:
    pass  # its rows come from the rejection stage's dataset URI, checked with the other inputs


def _check_alignment(cfg) -> None:
    from grpo.data.preferences import load_preference_data
    from grpo.data.tables import load_rl_data, read_table, validate_rows

    with _reading("alignment_grpo.data"):
        train, heldout = load_rl_data(cfg.data)
    _check_rewards("alignment_grpo", cfg.grpo, train, heldout)
    general = cfg.general_prompts
    if cfg.general_source != "synthetic":
        with _reading("alignment_grpo.general_source"):
            rows = validate_rows(read_table(cfg.general_source), {"prompt": "text or chat messages"},
                                 cfg.general_source)
        general = min(general, len(rows))
    with _reading("alignment_grpo"):
        check_prompts_per_step(cfg.grpo.prompts_per_step, len(train) + general,
                               f"{cfg.data.source} with {general} general prompts")
    if cfg.reward_model_uri is None:
        with _reading("alignment_grpo.preferences"):
            load_preference_data(cfg.preferences)
    elif cfg.reward_model_uri.startswith("runs:/"):
        check_uri("alignment_grpo.reward_model_uri", cfg.reward_model_uri)
    elif looks_like_a_path(cfg.reward_model_uri):
        _check_model_folder("alignment_grpo.reward_model_uri", cfg.reward_model_uri)


CHECKS = {"cold_start_sft": _check_cold_start, "reasoning_grpo": _check_reasoning,
          "rejection_sampling": _check_rejection, "sft": _check_sft, "alignment_grpo": _check_alignment}


def looks_like_a_path(name: str) -> bool:
    """Whether `name` means a local folder (a hub name is `org/name`, checked only by the hub)."""
    return name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1


def _check_model_folder(field: str, name: str) -> dict | None:
    """A local model folder's config.json (None for a hub name, which only the hub can check)."""
    path = Path(name).expanduser()
    if not looks_like_a_path(name):
        return None
    if not path.is_dir():
        raise UsageError(f"{field}: no model folder {name!r} (expected a folder with config.json, a hub name "
                         f"such as Qwen/Qwen2.5-0.5B, or tiny)")
    config = path / "config.json"
    try:
        return json.loads(config.read_text())
    except FileNotFoundError:
        raise UsageError(f"{field}: {name!r} has no config.json; expected a model folder saved with "
                         "save_pretrained") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{field}: cannot read {config}: {e}") from None


def _check_models(recipe: Recipe, stages: Sequence[str]) -> None:
    """The models the selected stages load by name, and their context against the recipe's token budgets."""
    loads = {"cold_start_sft": [("cold_start_sft.model.name_or_path", recipe.cold_start_sft.model)],
             "sft": [("sft.model.name_or_path", recipe.sft.model)],
             "alignment_grpo": [("alignment_grpo.reward_model.model.name_or_path",
                                 recipe.alignment_grpo.reward_model.model)]}
    if recipe.alignment_grpo.reward_model_uri:  # a given reward model: nothing is trained from a backbone
        loads["alignment_grpo"] = []
    contexts: dict[str, int] = {}
    for stage in stages:
        for field, model in loads.get(stage, []):
            config = _check_model_folder(field, model.name_or_path) if model.name_or_path != TINY else None
            if config and "max_position_embeddings" in config:
                contexts[model.name_or_path] = int(config["max_position_embeddings"])
    for field, tokens, model, plus_prompt in recipe.token_budgets():
        if field.split(".")[0] in stages and model.name_or_path in contexts:
            try:
                check_fits_context(field, tokens, contexts[model.name_or_path], plus_prompt)
            except ValueError as e:
                raise UsageError(f"{e} ({model.name_or_path})") from None


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
    batches = {"cold_start_sft": {"train__batch_size": recipe.cold_start_sft.train.batch_size},
               "reasoning_grpo": {"grpo__prompts_per_step": recipe.reasoning_grpo.grpo.prompts_per_step},
               "sft": {"train__batch_size": recipe.sft.train.batch_size},
               "alignment_grpo": {"grpo__prompts_per_step": recipe.alignment_grpo.grpo.prompts_per_step,
                                  "reward_model__batch_size": recipe.alignment_grpo.reward_model.batch_size}}
    for stage in stages:
        cfg = getattr(getattr(recipe, stage), "distributed", None)
        if cfg is None or (cfg.num_processes == 1 and cfg.config_file is None):
            continue
        from tasks import launch  # reads the GPUs (imports torch): only when a stage asks for processes

        try:
            launch.check_splits(cfg, **batches[stage])
            if cfg.config_file:
                launch.config_file_path(cfg.config_file)
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(f"{stage}: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# The machine and the services around it


def check_state_folder() -> None:
    """R1_HOME (or the default .r1/) is a folder this user can write, or can be made."""
    from tasks.env import PROJECT_ROOT

    home = Path(os.environ.get("R1_HOME") or PROJECT_ROOT / ".r1").expanduser()
    what = f"R1_HOME={home}" if os.environ.get("R1_HOME") else f"the state folder {home}"
    if home.exists() and not home.is_dir():
        raise UsageError(f"{what} is a file; expected a folder for Prefect's and MLflow's state")
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{what}: cannot make the folder ({e.strerror}); point R1_HOME at a writable folder") from None
    if not os.access(home, os.W_OK | os.X_OK):
        raise UsageError(f"{what} is not writable; point R1_HOME at a writable folder")


def _answers(url: str, timeout: float = 5.0) -> str | None:
    """None if `url` answers 200, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return None if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def check_servers() -> None:
    """The MLflow and Prefect servers the environment names answer (the embedded default has none to check)."""
    mlflow_uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if mlflow_uri.startswith(("http://", "https://")):
        why = _answers(mlflow_uri.rstrip("/") + "/health")
        if why:
            raise UsageError(f"MLFLOW_TRACKING_URI={mlflow_uri}: no MLflow server answers ({why}); start it, "
                             "or unset the variable to track under R1_HOME")
    elif mlflow_uri and not mlflow_uri.startswith(("sqlite:", "postgresql", "mysql", "mssql", "databricks")):
        raise UsageError(f"MLFLOW_TRACKING_URI={mlflow_uri}: expected an http(s):// server or a database URI "
                         "such as sqlite:///path/mlflow.db")
    prefect_api = os.environ.get("PREFECT_API_URL", "")
    if prefect_api:
        why = _answers(prefect_api.rstrip("/") + "/health")
        if why:
            raise UsageError(f"PREFECT_API_URL={prefect_api}: no Prefect server answers ({why}); start it "
                             "(`r1 up` or `prefect server start`), or unset the variable for a temporary one")


def check_judge_endpoint(cfg) -> None:
    """An HTTP judge answers and serves the model the recipe names (one quick try: the stage retries later)."""
    from grpo.sampling.judge import HTTPJudge, JudgeUnavailable

    quick = cfg.model_copy(update={"max_retries": 0, "timeout_s": min(cfg.timeout_s, 10.0)})
    try:
        HTTPJudge(quick).check_available()
    except JudgeUnavailable as e:
        raise UsageError(f"rejection_sampling.judge: {e}") from None


def check_port(flag: str, port: int, host: str = "127.0.0.1") -> None:
    """`port` is a port number and free on `host` (0 picks a free one)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"{flag} must be in 0..65535 (0 picks a free port), got {port}")
    if port == 0:
        return
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"{flag} {port}: cannot listen on {host}:{port} ({e.strerror}); pick another port "
                             "(0 picks a free one)") from None


# ----------------------------------------------------------------------------------------------------------------
# Runs and URIs in MLflow


def _no_store_yet() -> str | None:
    """The tracking URI when it is a local SQLite file that does not exist yet (opening it would create it)."""
    from tasks import tracking

    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return uri
    return None


def check_run(what: str, run_id: str):
    """The MLflow run `run_id`; fails naming `what` (the flag that gave it) if there is none."""
    from mlflow.exceptions import MlflowException

    from tasks import tracking

    empty = _no_store_yet()
    if empty:
        raise UsageError(f"{what}: no MLflow run {run_id!r}: the tracking store {empty} has no runs yet")
    try:
        return tracking.client().get_run(run_id)
    except MlflowException as e:
        raise UsageError(f"{what}: no MLflow run {run_id!r} in {tracking.tracking_uri()} "
                         f"({e.error_code}); `r1 where` says where runs are tracked") from None


def check_from_run(run_id: str) -> dict[str, str]:
    """The URIs a pipeline run recorded; fails if there is no such run or it is not a pipeline run."""
    run = check_run("--from-run", run_id)
    uris = {k[len("uri."):]: v for k, v in run.data.tags.items() if k.startswith("uri.")}
    if not uris:
        raise UsageError(f"--from-run {run_id}: the run records no stage URIs (uri.* tags); expected a pipeline "
                         f"run (the parent run `r1 run` prints), got {run.data.tags.get('mlflow.runName', 'a run')!r}")
    return uris


def check_uri(flag: str, uri: str) -> None:
    """A stage input: a `runs:/<id>/<path>` whose run and artifact exist, or a local path that exists."""
    if uri.startswith("runs:/"):
        run_id, _, path = uri[len("runs:/"):].partition("/")
        check_run(flag, run_id)
        from tasks import tracking

        if path and not tracking.client().list_artifacts(run_id, path):
            raise UsageError(f"{flag} {uri}: run {run_id} has no artifact {path!r}")
    elif "://" not in uri and not uri.startswith("models:") and not Path(uri).exists():
        raise UsageError(f"{flag} {uri}: no such file or folder; expected runs:/<run id>/<artifact> or a local path")
