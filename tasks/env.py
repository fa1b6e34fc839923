"""The embedded default: Prefect and MLflow state under R1_HOME unless the user points them at real servers."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
LOCAL_API = "R1_LOCAL_PREFECT_API"  # the URL of the Prefect API an `r1` process started for itself (flows.cli.local_api)


def use_local_defaults() -> None:
    """Set Prefect's home and switches for an offline machine; variables the user set are left alone.

    Runs on import of `tasks`, before Prefect reads its settings. `PREFECT_API_URL` (a real server) and
    `MLFLOW_TRACKING_URI` (a real tracking server) take precedence over everything here.
    """
    home = Path(os.environ.get("R1_HOME") or PROJECT_ROOT / ".r1").resolve()
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    # Prefect's local API opens its SQLite file there but does not create the folder: a fresh clone has none
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # the local API migrates a new database before it answers; on a fresh folder and a busy 2-core machine that can
    # take longer than Prefect's 20 s default
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT", "false")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
