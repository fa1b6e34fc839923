"""The embedded default: Prefect and MLflow state under R1_HOME unless the user points them at real servers."""

from __future__ import annotations

import logging
import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
LOCAL_API = "R1_LOCAL_PREFECT_API"  # the URL of the Prefect API an `r1` process started for itself (flows.cli.local_api)


def home_path() -> Path:
    """The state folder: R1_HOME, or `.r1/` in the checkout (not made here; `tracking.r1_home` makes it). The one
    place it is read."""
    return Path(os.environ.get("R1_HOME") or PROJECT_ROOT / ".r1").expanduser().resolve()


def embedded_uri() -> str:
    """The embedded default's MLflow store: a SQLite file in the state folder (not made here)."""
    return f"sqlite:///{home_path() / 'mlflow.db'}"


def tracking_uri() -> str:
    """Where MLflow runs go: MLFLOW_TRACKING_URI, else the embedded store; read without importing MLflow (what `r1`
    says in its first line)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or embedded_uri()


def use_local_defaults() -> None:
    """Set Prefect's home and switches for an offline machine; variables the user set are left alone.

    Runs on import of `tasks`, before Prefect reads its settings. `PREFECT_API_URL` (a real server) and
    `MLFLOW_TRACKING_URI` (a real tracking server) take precedence over everything here.
    """
    home = home_path()
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    # Prefect's local API opens its SQLite file there but does not create the folder: a fresh clone has none
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # the local API migrates a new database before it answers; on a fresh folder and a busy 2-core machine that can
    # take longer than Prefect's 20 s default
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT", "false")
    os.environ.setdefault("R1_MODEL_CACHE", str(home / "models"))  # GGUF models dequantized once (grpo.model_files)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


# Library log lines that tell a person nothing they can act on and that the project's calls cannot avoid, by logger
# and the start of the message; everything else these loggers say still shows.
QUIET = {
    # bitsandbytes (the 8-bit AdamW) on a CPU with avx512_bf16 looks on the hub for an optional 4-bit matmul kernel
    # when imported, and says when it is not there; the project never runs a 4-bit matmul
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward",),
    # mlflow.transformers looks a logged model's name up on the hub for a model card and a license; the final model
    # is a local folder with no name there, so both lookups fail, every time, and say so
    "mlflow.transformers": ("The model card could not be retrieved", "Unable to find license information"),
    # urllib3 logs each retry of a request to a tracking server that does not answer; runtime.outage says it once
    "urllib3.connectionpool": ("Retrying (",),
}
# Loggers that tell a full disk again in a library's words (MLflow's SQLite store logs each failed statement with its
# traceback and SQL; Prefect's failed runs cannot write their result records either), and those words. `r1` ends
# with the one line of `grpo.faults` that says where, how much, and what to do, so these records are dropped.
DISK_FULL_WORDS = ("database or disk is full", "No space left on device", "Disk quota exceeded", "File too large")
TOLD_BY_R1 = ("mlflow.store.db.utils", "prefect.flow_runs", "prefect.task_runs")


class _Quiet(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


class _FaultWithoutTraceback(logging.Filter):
    """Prefect logs a failed task or flow run with its traceback; for a fault of the machine or a store (a full
    disk, a damaged file: `grpo.faults`) the line `r1` prints says all there is, so the record keeps its message
    and loses the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and _is_fault(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


class _DiskFullTold(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        from grpo.faults import file_size_limit

        message = record.getMessage()
        if "disk I/O error" in message and file_size_limit() is not None:  # SQLite's words for a write over it
            return False
        return not any(words in message for words in DISK_FULL_WORDS)


def _is_fault(e: BaseException) -> bool:
    from grpo.faults import disk_fault

    return disk_fault(e, [home_path()]) is not None


def quiet_libraries() -> None:
    """Drop the `QUIET` lines at their loggers (which need not be imported yet), the tracebacks Prefect logs with a
    fault, and a full disk told again in a library's words (`TOLD_BY_R1`); once per process."""
    for name, starts in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Quiet) for f in logger.filters):
            logger.addFilter(_Quiet(starts))
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FaultWithoutTraceback) for f in logger.filters):
            logger.addFilter(_FaultWithoutTraceback())
    for name in TOLD_BY_R1:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DiskFullTold) for f in logger.filters):
            logger.addFilter(_DiskFullTold())
