"""Fixtures of the `r1` command's tests. The session's environment and fixtures are the root conftest's
(tests/conftest.py); nothing is set up again here."""

from __future__ import annotations

import pytest

from cli_workspace import Workspace


@pytest.fixture
def ws(tmp_path, monkeypatch):
    """A fresh state folder and MLflow store for one `r1` command (the error catalogue's workspace)."""
    w = Workspace(tmp_path)
    monkeypatch.setenv("R1_HOME", str(w.home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{w.db}")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return w
