"""A heartbeat on every MLflow run this process has open, so a run whose process or pod died is found as such.

`end_dead_runs` can ask a process on its own host whether it still lives (host, pid and start time), but not one on
a pod that was preempted or a node that was lost: those runs would stay RUNNING forever. So every open run is
tagged `r1.heartbeat` (epoch milliseconds) every `R1_HEARTBEAT_S` seconds (30 by default; the run records the
interval as `r1.heartbeat_s`) from one daemon thread, and a RUNNING run whose heartbeat is older than `STALE_BEATS`
intervals is dead wherever it ran. A pipeline waiting on a placed stage reads the same tag to tell a stage that is
slow from one that is gone. Runs beat where the tracking store is shared (a server or a database); on a local SQLite
file, which serves one machine, `end_dead_runs` asks for the owning process instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

STALE_BEATS = 5  # missed beats after which a run counts as dead (a busy tracking server may delay one or two)
TAG, INTERVAL_TAG = "r1.heartbeat", "r1.heartbeat_s"
log = logging.getLogger(__name__)

_open: dict[str, Callable[[str, str], None]] = {}  # run id -> how to write its heartbeat tag
_lock = threading.Lock()
_thread: threading.Thread | None = None


def interval_s() -> float:
    value = os.environ.get("R1_HEARTBEAT_S", "30")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"R1_HEARTBEAT_S={value!r}: expected seconds between heartbeats, such as 30") from None
    if not 0.1 <= seconds <= 3600:
        raise ValueError(f"R1_HEARTBEAT_S={value!r}: expected 0.1 to 3600 seconds")
    return seconds


def first_beat() -> dict[str, str]:
    """The tags a run starts with: its first heartbeat and the interval of the next ones."""
    return {TAG: str(int(time.time() * 1000)), INTERVAL_TAG: str(interval_s())}


def is_stale(tags: dict[str, str], now_ms: float | None = None) -> bool:
    """Whether a run's last heartbeat is older than STALE_BEATS of its intervals (False for a run without one)."""
    try:
        last, every = float(tags[TAG]), float(tags[INTERVAL_TAG])
    except (KeyError, ValueError):
        return False
    now_ms = time.time() * 1000 if now_ms is None else now_ms
    return now_ms - last > STALE_BEATS * every * 1000


def beat_for(run_id: str, write: Callable[[str, str], None]) -> None:
    """Keep `run_id`'s heartbeat going from this process until `stop_beating(run_id)`: `write(run_id, epoch ms)`."""
    global _thread
    with _lock:
        _open[run_id] = write
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_beat, name="r1-heartbeat", daemon=True)
            _thread.start()


def stop_beating(run_id: str) -> None:
    with _lock:
        _open.pop(run_id, None)


def _beat() -> None:
    every = interval_s()
    while True:
        time.sleep(every)
        with _lock:
            runs = list(_open.items())
        now = str(int(time.time() * 1000))
        for run_id, write in runs:
            try:
                write(run_id, now)
            except Exception as e:  # noqa: BLE001 (a tracking server down for a moment must not end the process)
                log.warning("heartbeat of run %s not written: %s", run_id, e)
