"""New SQLite stores made from a migrated copy instead of by their migrations.

A store that starts on a database file that does not exist yet creates its tables and runs every migration: MLflow's
takes ~2 s of CPU and 5 on a busy 2-core machine, Prefect's ~10 (flows.cli.prefect_db), and every new R1_HOME, every
`r1 up` and every test that runs `r1` on a fresh folder paid both. So a migrated copy is kept in the user's cache
(`R1_CACHE`, else `$XDG_CACHE_HOME/r1`, else `~/.cache/r1`), named by the library's version, and a new database
starts as that copy. A file that exists is never touched. `R1_STORE_CACHE=0` turns it off (and
`R1_PREFECT_DB_CACHE=0`, Prefect's alone).

MLflow's copy holds its tables and migrations and no experiment: the store that opens it makes its own `Default`
experiment, with the artifact folder that store was given.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

CACHE_OFF = "R1_STORE_CACHE"


def cache_dir() -> Path:
    if os.environ.get("R1_CACHE"):
        return Path(os.environ["R1_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "r1"


def enabled() -> bool:
    return os.environ.get(CACHE_OFF, "1") != "0"


def copy_new(template: Path, db: Path) -> bool:
    """Make `db` as a copy of `template` where `db` does not exist yet and `template` does; whether it was made.
    The copy lands under another name and is renamed, so no store ever opens half a file."""
    if db.exists() or not template.is_file():
        return False
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=f".{db.stem}-", suffix=".db", dir=db.parent)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as out, template.open("rb") as src:
            shutil.copyfileobj(src, out)
        if db.exists():  # made meanwhile by someone else: theirs stands
            os.unlink(part)
            return False
        os.replace(part, db)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(part)
        return False
    return True


def mlflow_template() -> Path | None:
    """The migrated MLflow database in the cache, made now if there is none (None where it cannot be: a read-only
    or full cache costs a new store its migrations, nothing more)."""
    import mlflow

    template = cache_dir() / f"mlflow-{mlflow.__version__}.db"
    if template.is_file():
        return template
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=".mlflow-", dir=template.parent))
    except OSError:
        return None
    try:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        part = scratch / "mlflow.db"
        store = SqlAlchemyStore(f"sqlite:///{part}", (scratch / "artifacts").as_uri())
        store.engine.dispose()
        db = sqlite3.connect(part)
        try:
            with db:
                db.execute("DELETE FROM experiment_tags")
                db.execute("DELETE FROM experiments")  # the Default one, whose artifact folder was this scratch's
            if db.execute("SELECT count(*) FROM runs").fetchone()[0]:
                return None
        finally:
            db.close()
        os.replace(part, template)
        return template
    except (OSError, sqlite3.Error, ImportError, mlflow.exceptions.MlflowException):
        return None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def seed_mlflow(db: Path) -> bool:
    """Make the MLflow SQLite database `db` from the migrated copy where it does not exist yet; whether it was."""
    if not enabled() or db.exists():
        return False
    template = mlflow_template()
    return template is not None and copy_new(template, db)
