"""A new Prefect home's database, made from a migrated copy instead of by Prefect's migrations.

A Prefect server that starts on a home with no database creates it and runs every migration, then registers its
block types: about 18 s on a 2-core CPU, where a server on a migrated database answers in about 6. Each new home
(`r1 run` or `r1 up` on a new R1_HOME, every test that runs `r1` on a fresh folder) paid it. So the first server
that makes a database leaves a copy of it, taken once it answers (migrations and block types, no runs), in the
user's cache (runtime.store_copies: `R1_CACHE`, else `$XDG_CACHE_HOME/r1`, else `~/.cache/r1`), named by Prefect's
version; a new home's database starts as that copy, and the server finds its migrations done. A home with a database keeps it, and a
database configured elsewhere (`PREFECT_SERVER_DATABASE_CONNECTION_URL`, Postgres) is left alone: only the default
SQLite file in the home is made this way. `R1_PREFECT_DB_CACHE=0` (or `R1_STORE_CACHE=0`) turns it off.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
from pathlib import Path

from runtime.store_copies import cache_dir, copy_new, enabled

CACHE_OFF = "R1_PREFECT_DB_CACHE"


def _template() -> Path:
    import prefect

    return cache_dir() / f"prefect-{prefect.__version__}.db"


def default_database(home: Path, url: str | None = None) -> Path | None:
    """The home's own SQLite file where the server will use it (the default, or `url` naming that file); None for a
    database configured elsewhere, or with the cache turned off."""
    if os.environ.get(CACHE_OFF, "1") == "0" or not enabled():
        return None
    db = home / "prefect.db"
    if url is None:
        from prefect.settings import get_current_settings

        configured = get_current_settings().server.database.connection_url
        url = configured.get_secret_value() if configured is not None else None
    if url is None or url == f"sqlite+aiosqlite:///{db}":
        return db
    return None


def seed(db: Path | None) -> bool:
    """Make `db` from the migrated copy, where `db` does not exist yet and a copy does; whether it was made. The copy
    lands under another name and is renamed, so a server never opens half a file."""
    return db is not None and copy_new(_template(), db)


def keep(db: Path | None) -> None:
    """Leave a copy of `db` (made by a server that has just answered its first health check) for the next new home,
    where none is kept yet. SQLite's backup: a consistent copy while the server runs. Best effort: a full or
    read-only cache only costs the next home its migrations."""
    if db is None or not db.is_file():
        return
    template = _template()
    if template.exists():
        return
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=".prefect-", suffix=".db", dir=template.parent)
        os.close(fd)
        src = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        out = sqlite3.connect(part)
        try:
            with out:
                src.backup(out)
            runs = out.execute("SELECT count(*) FROM flow_run").fetchone()[0]
        finally:
            out.close()
            src.close()
        if runs:  # not a new home's database after all: nothing of a user's goes into the cache
            os.unlink(part)
            return
        os.replace(part, template)
    except (OSError, sqlite3.Error):
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(part)
