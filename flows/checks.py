"""The helpers of each stage's pre-flight (flows/stage_checks.py): each reads files or asks a server, loads no model
and trains nothing, and fails with a `UsageError` that names the field and what was expected.

`r1` runs the stages' pre-flights before anything starts, with the checks of the machine it runs on
(flows/cli/preflight.py).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class UsageError(ValueError):
    """A mistake in what was asked for (recipe, data, model, run id, endpoint, port, folder): one line, exit 2."""


@contextmanager
def reading(field: str) -> Iterator[None]:
    """A dataset that cannot be used, or a synthetic task that cannot make the rows asked for, named by field."""
    from grpo.data.tables import DataError

    try:
        yield
    except UsageError:
        raise
    except (DataError, ValueError) as e:
        raise UsageError(f"{field}: {e}") from None


def has_tests(rows) -> bool:
    """Whether some of `rows` are code rows, judged by running their tests (in the sandbox, wherever they are)."""
    return rows is not None and bool({"tests", "io_tests"} & set(rows.columns))


def check_sandbox(field: str, code=None) -> None:
    """Programs can run sandboxed here under `code` (a CodeConfig; the defaults evaluation uses when None): checked
    before any training, since the first program would otherwise fail the stage after it has trained."""
    from grpo.configs.code import CodeConfig
    from grpo.rewards import SandboxUnavailable
    from grpo.rewards.code import code_limits
    from grpo.rewards.sandbox import check_sandbox

    try:
        check_sandbox(code_limits((code or CodeConfig()).model_dump()))
    except SandboxUnavailable as e:
        raise UsageError(f"{field}: {e}") from None


def check_rewards(stage: str, grpo, train, heldout=None) -> None:
    """The rewards' columns in the rows, and for the code reward (or held-out rows that evaluation checks by their
    tests) a sandbox that works on this machine."""
    from grpo.rewards import check_reward_columns

    with reading(f"{stage}.data"):
        check_reward_columns(grpo.rewards, train.columns, "its rows")
    if "code" in grpo.rewards or has_tests(heldout):
        field = "grpo.rewards" if "code" in grpo.rewards else "data.heldout_source"
        check_sandbox(f"{stage}.{field}", grpo.grading.code)


def looks_like_a_path(name: str) -> bool:
    """Whether `name` means a local folder (a hub name is `org/name`, checked only by the hub)."""
    return name.startswith((".", "/", "~")) or Path(name).exists() or name.count("/") > 1


def check_model_folder(field: str, name: str) -> dict | None:
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


def check_judge_endpoint(cfg) -> None:
    """An HTTP judge answers and serves the model the recipe names (one quick try: the stage retries later)."""
    from grpo.sampling.judge import HTTPJudge, JudgeUnavailable

    quick = cfg.model_copy(update={"max_retries": 0, "timeout_s": min(cfg.timeout_s, 10.0)})
    try:
        HTTPJudge(quick).check_available()
    except JudgeUnavailable as e:
        raise UsageError(f"rejection_sampling.judge: {e}") from None


def _no_store_yet() -> str | None:
    """The tracking URI when it is a local SQLite file that does not exist yet (opening it would create it)."""
    from runtime import tracking

    uri = tracking.tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return uri
    return None


def check_run(what: str, run_id: str):
    """The MLflow run `run_id`; fails naming `what` (the flag that gave it) if there is none."""
    from mlflow.exceptions import MlflowException

    from runtime import tracking

    empty = _no_store_yet()
    if empty:
        raise UsageError(f"{what}: no MLflow run {run_id!r}: the tracking store {empty} has no runs yet")
    try:
        return tracking.client().get_run(run_id)
    except MlflowException as e:
        raise UsageError(f"{what}: no MLflow run {run_id!r} in {tracking.tracking_uri()} "
                         f"({e.error_code}); `r1 where` says where runs are tracked") from None


def check_uri(flag: str, uri: str) -> None:
    """A stage input: a `runs:/<id>/<path>` whose run and artifact exist, or a local path that exists."""
    if uri.startswith("runs:/"):
        run_id, _, path = uri[len("runs:/"):].partition("/")
        check_run(flag, run_id)
        from runtime import tracking

        if path and not tracking.client().list_artifacts(run_id, path):
            raise UsageError(f"{flag} {uri}: run {run_id} has no artifact {path!r}")
    elif "://" not in uri and not uri.startswith("models:") and not Path(uri).exists():
        raise UsageError(f"{flag} {uri}: no such file or folder; expected runs:/<run id>/<artifact> or a local path")
