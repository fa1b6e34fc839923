"""The stack's MLflow login settings as MLflow itself reads them (its basic-auth app's config parser)."""

from __future__ import annotations

import pytest


@pytest.mark.filterwarnings("ignore:starlette.middleware.wsgi is deprecated")  # MLflow's server app, on import
def test_the_mlflow_server_reads_the_stack_s_auth_settings_with_its_login_cache_on(tmp_path, monkeypatch):
    from mlflow.server.auth.config import read_auth_config

    from flows.cli.credentials import AUTH_CACHE_TTL_S, DEFAULT_PERMISSION, ensure_credentials, mlflow_server_env

    monkeypatch.setenv("R1_HOME", str(tmp_path))
    env = mlflow_server_env(ensure_credentials())
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", env["MLFLOW_AUTH_CONFIG_PATH"])
    config = read_auth_config()
    # a checked login is trusted for a minute: each check is a scrypt hash (~0.1 s of the server's CPU a request
    # otherwise; benchmarks/stack_logins.py)
    assert AUTH_CACHE_TTL_S > 0 and config.auth_cache_ttl_seconds == AUTH_CACHE_TTL_S
    assert config.default_permission == DEFAULT_PERMISSION
    assert config.database_uri == f"sqlite:///{tmp_path / 'auth' / 'mlflow-auth.db'}"
    assert "PASSWORD" not in open(env["MLFLOW_AUTH_CONFIG_PATH"]).read().upper()  # no secret in the file
