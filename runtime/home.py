"""An embedded home (R1_HOME) copied, moved, restored from a backup or mounted at another path: re-rooted on start.

MLflow's SQLite store records where artifacts are as absolute `file://` URIs: the experiment's artifact location,
fixed when the experiment is made, and each run's below it (MLflow makes a local path absolute before it records
it, so a location relative to the home is not something the store can keep). The project's tags name work folders
the same way. A home found at another path than the one its store names would still read and write its artifacts
under the old path: gone after a move, and after a copy the original's, full or not.

So the first open of the embedded store in a process (`runtime.tracking.client`, under the lock that serialises
opening it) compares the home the experiments' artifact locations name (`<home>/mlartifacts`, the layout
`runtime.tracking.experiment_id` makes) with the home in use, and where they differ rewrites every path under the
old home in the store to the same path under the new one, in one transaction, and says so in one line. Done on
start rather than by a command so that the same `r1` command carries on where it stopped, as the fault lines
advise; the store is the one place that names the home's path (work folders are keyed by their inputs, downloads
by their URI, checkpoints hold relative names), so nothing else needs changing.

With a tracking server (`MLFLOW_TRACKING_URI`) the artifacts live in the server's own store and nothing here moves
or is rewritten; a moved R1_HOME then only holds work folders, which are found again by their key.

Plain sqlite3: it runs before MLflow opens the store.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

ARTIFACTS = "mlartifacts"  # the embedded store's artifact folder, beside mlflow.db in the home

log = logging.getLogger(__name__)


def recorded_homes(con: sqlite3.Connection) -> set[str]:
    """The homes the store's experiments keep their artifacts under (`file://<home>/mlartifacts`)."""
    try:
        rows = con.execute("SELECT artifact_location FROM experiments").fetchall()
    except sqlite3.OperationalError:  # a store MLflow has not made its tables in yet
        return set()
    homes = set()
    for (location,) in rows:
        parsed = urlparse(location or "")
        if parsed.scheme in ("file", "") and parsed.path.rstrip("/").endswith(f"/{ARTIFACTS}"):
            homes.add(str(Path(unquote(parsed.path)).parent))
    return homes


def _same_store(old: str, db: Path) -> bool:
    """Whether `old` is where `db` is now under another name (a symbolic link, a second mount of the same disk)."""
    try:
        return (Path(old) / db.name).samefile(db)
    except OSError:
        return False


def _text_columns(con: sqlite3.Connection) -> list[tuple[str, str]]:
    tables = [t for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    return [(t, c) for t in tables for _, c, kind, *_ in con.execute(f'PRAGMA table_info("{t}")')
            if any(word in (kind or "TEXT").upper() for word in ("CHAR", "TEXT", "CLOB"))]


def reroot(db: Path, home: Path) -> str | None:
    """Rewrite the paths under an earlier home that the store at `db` records to the same paths under `home`;
    return the line that says so, or None when the store names no other home."""
    if not db.exists():
        return None
    home = home.resolve()
    with sqlite3.connect(db, timeout=60) as con:  # one transaction: all of it or, on an error, none
        old_homes = sorted(h for h in recorded_homes(con) if h != str(home) and not _same_store(h, db))
        if not old_homes:
            return None
        columns = _text_columns(con)
        changed = 0
        for old in old_homes:
            pairs = {old: str(home), quote(old): quote(str(home))}  # plain paths, and as file URIs spell them
            for before, after in pairs.items():
                for table, column in columns:
                    cur = con.execute(
                        f'UPDATE "{table}" SET "{column}" = CASE WHEN "{column}" = ? THEN ? '
                        f'ELSE replace("{column}", ?, ?) END WHERE "{column}" = ? OR instr("{column}", ?) > 0',
                        (before, after, before + "/", after + "/", before, before + "/"))
                    changed += cur.rowcount
    moved = ", ".join(old_homes)
    return (f"R1_HOME has moved from {moved} to {home}: {changed} artifact locations and work folders recorded in its "
            f"MLflow store now point under {home}")


def reroot_embedded_store(db: Path, home: Path) -> None:
    """`reroot`, said in one line where there was something to do."""
    line = reroot(db, home)
    if line:
        log.warning(line)
