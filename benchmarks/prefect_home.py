"""How long `r1`'s local Prefect API takes to answer on a new home: with the migrated copy of its database that the
first new home leaves in the cache (flows/cli/prefect_db.py), and without it (R1_PREFECT_DB_CACHE=0: Prefect makes
the database and runs every migration). Each start is a process of its own on a fresh PREFECT_HOME, in turns,
`--pairs` times; the cache is a fresh folder, filled by one start before the first timed one. Prints one JSON line a
start and the medians.

    .venv/bin/python benchmarks/prefect_home.py --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

START = """
import time
t = time.monotonic()
from flows.cli.local_api import local_prefect_api
with local_prefect_api() as url:
    assert url
    print(time.monotonic() - t)
"""


def start(home: Path, cache: Path, copy: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "R1_PREFECT_DB_CACHE")}
    env.update(PREFECT_HOME=str(home), R1_CACHE=str(cache), PYTHONPATH=str(ROOT),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", **({} if copy else {"R1_PREFECT_DB_CACHE": "0"}))
    out = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="r1-prefect-home-") as tmp:
        root = Path(tmp)
        start(root / "first", root / "cache", True)  # leaves the copy
        times: dict[str, list[float]] = {"migrations": [], "migrated copy": []}
        for i in range(args.pairs):
            for way, copy in (("migrations", False), ("migrated copy", True)):
                seconds = start(root / f"{way.replace(' ', '-')}-{i}", root / "cache", copy)
                times[way].append(seconds)
                print(json.dumps({"way": way, "pair": i, "seconds_to_answer": round(seconds, 2)}), flush=True)
        med = {way: statistics.median(t) for way, t in times.items()}
        print(json.dumps({"median_s": {w: round(v, 2) for w, v in med.items()},
                          "saved_s": round(med["migrations"] - med["migrated copy"], 2)}))


if __name__ == "__main__":
    main()
