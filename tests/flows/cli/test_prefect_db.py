"""A new Prefect home's database made from a migrated copy (flows.cli.prefect_db): the first local API on a new home
leaves a copy once it answers, the next new home starts from it and is served, a home with runs never becomes the
copy, and a database configured elsewhere is left alone."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from flows.cli import prefect_db

ROOT = Path(__file__).resolve().parents[3]

# one `r1`-like process: the local API on PREFECT_HOME, and a flow run recorded through it
RUN_ONE_FLOW = """
from prefect import flow
from flows.cli.local_api import local_prefect_api

@flow
def hello():
    return 1

with local_prefect_api() as url:
    assert url, "no local API started"
    hello()
"""


def _run(home: Path, cache: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), R1_CACHE=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", RUN_ONE_FLOW], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def _count(db: Path, table: str) -> int:
    with sqlite3.connect(db) as con:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def test_a_new_home_starts_from_the_copy_the_first_one_left(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("R1_CACHE", str(cache))
    template = cache / f"prefect-{__import__('prefect').__version__}.db"

    _run(tmp_path / "a", cache)  # a new home, no copy yet: Prefect migrates, and the copy is left once it answers
    assert template.is_file()
    assert _count(template, "flow_run") == 0  # taken before the run: nothing of the first home's in it
    assert _count(template, "block_type") > 0 and _count(template, "alembic_version") == 1
    assert _count(tmp_path / "a" / "prefect.db", "flow_run") == 1

    b = tmp_path / "b" / "prefect.db"
    assert prefect_db.seed(b) and _count(b, "alembic_version") == 1  # what the next new home starts from
    b.unlink()
    _run(tmp_path / "b", cache)  # served from the copy: the run lands in b's database, the copy stays empty
    assert _count(b, "flow_run") == 1 and _count(template, "flow_run") == 0

    assert not prefect_db.seed(b)  # a home with a database keeps it
    assert _count(b, "flow_run") == 1

    template.unlink()
    prefect_db.keep(b)  # a database with runs never becomes the copy
    assert not template.exists()


def test_only_the_homes_own_sqlite_file_is_made(tmp_path, monkeypatch):
    home = tmp_path / "home"
    assert prefect_db.default_database(home, f"sqlite+aiosqlite:///{home / 'prefect.db'}") == home / "prefect.db"
    assert prefect_db.default_database(home, "postgresql+asyncpg://prefect@db:5432/prefect") is None
    assert prefect_db.default_database(home, f"sqlite+aiosqlite:///{tmp_path / 'elsewhere.db'}") is None
    monkeypatch.setenv("R1_PREFECT_DB_CACHE", "0")
    assert prefect_db.default_database(home, f"sqlite+aiosqlite:///{home / 'prefect.db'}") is None
