"""System metrics on every stage run: CPU, memory, disk and network, and GPU where there is one (`system/...`).

MLflow's own collectors take the samples (those of `mlflow.system_metrics`, so the names and the UI's "System
metrics" charts are MLflow's: `system/cpu_utilization_percentage`, `system/system_memory_usage_megabytes`,
`system/gpu_0_utilization_percentage`, ...; GPU figures need `nvidia-ml-py`). How they are written depends on the
tracking store:

- a tracking server (`http(s)://`): MLflow's `SystemMetricsMonitor` logs live from its thread against the stage's
  run id, as `mlflow.start_run(log_system_metrics=True)` would; the server serialises the writes.
- a local store (the embedded SQLite): samples are kept in memory and written in batches from the stage's own
  thread when the stage ends (finished, failed or interrupted). A monitor thread writing to the SQLite file beside
  the stage's threads made MLflow's writes fail with "database is locked". Those connections already wait 5 s for
  a lock (Python's sqlite3 default), so a longer busy timeout is no cure: SQLite answers a transaction that read
  and must now write, while another holds the write lock, with SQLITE_BUSY at once, without waiting. A stage on
  one machine loses only the live view by waiting; the figures keep their sampling times, so the charts are the
  same.

Samples are taken every `MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL` seconds (10 by default, as MLflow), plus one at
the end, so even a short stage has a figure; `R1_SYSTEM_METRICS=0` turns them off.
"""

from __future__ import annotations

import os
import threading
import time

from mlflow.entities import Metric

from runtime import tracking

PREFIX = "system/"
DEFAULT_INTERVAL_S = 10.0
BATCH = 1000  # MLflow's cap on metrics in one log_batch


def enabled() -> bool:
    return os.environ.get("R1_SYSTEM_METRICS", "1").lower() not in ("0", "false", "no", "off")


def interval_s() -> float:
    from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL

    return float(MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() or DEFAULT_INTERVAL_S)


def _collectors() -> list:
    """MLflow's CPU (with memory), disk and network collectors, and its GPU one where a GPU answers."""
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    collectors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
    try:
        from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

        collectors.append(GPUMonitor())
    except Exception:  # no nvidia-ml-py, or no NVIDIA GPU: nothing to report
        pass
    return collectors


class BufferedSystemMetrics:
    """Samples in a daemon thread, kept in memory; `stop()` writes them all to the run from the caller's thread."""

    def __init__(self, run_id: str, every_s: float):
        self.run_id, self.every_s = run_id, every_s
        self.collectors = _collectors()
        self.samples: list[tuple[int, int, dict[str, float]]] = []  # (step, time in ms, {name: value})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True, name=f"r1-system-{run_id}")

    def start(self) -> "BufferedSystemMetrics":
        self._thread.start()
        return self

    def _collect(self) -> None:
        for c in self.collectors:
            c.collect_metrics()

    def _aggregate(self) -> None:
        figures = {}
        for c in self.collectors:
            figures.update(c.aggregate_metrics())
            c.clear_metrics()
        if figures:
            self.samples.append((len(self.samples), int(time.time() * 1000),
                                 {PREFIX + k: float(v) for k, v in figures.items()}))

    def _sample_until_stopped(self) -> None:
        # one sample at the start, then one aggregate per interval, as MLflow's own monitor does
        while True:
            self._collect()
            if self._stop.wait(self.every_s):
                return
            self._aggregate()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._collect()  # the end's figures, with what the interval in progress had
        self._aggregate()
        metrics = [Metric(k, v, ms, step) for step, ms, figures in self.samples for k, v in figures.items()]
        c = tracking.client()
        for i in range(0, len(metrics), BATCH):
            c.log_batch(self.run_id, metrics=metrics[i : i + BATCH])


class LiveSystemMetrics:
    """MLflow's `SystemMetricsMonitor` for a tracking server, started and stopped for one run."""

    def __init__(self, run_id: str, every_s: float):
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(run_id, sampling_interval=every_s, tracking_uri=tracking.tracking_uri())

    def start(self) -> "LiveSystemMetrics":
        self.monitor.start()
        return self

    def stop(self) -> None:
        self.monitor.finish()


def start(run_id: str) -> BufferedSystemMetrics | LiveSystemMetrics | None:
    """Start taking system metrics for `run_id`, the way its tracking store takes them; None when turned off."""
    if not enabled():
        return None
    live = tracking.tracking_uri().startswith(("http://", "https://"))
    return (LiveSystemMetrics if live else BufferedSystemMetrics)(run_id, interval_s()).start()


def stop(monitor: BufferedSystemMetrics | LiveSystemMetrics | None) -> None:
    """Stop taking them and write what is left; a failure to write them never fails the stage."""
    if monitor is None:
        return
    try:
        monitor.stop()
    except Exception as e:  # the figures are worth less than the stage's own end
        import logging

        logging.getLogger(__name__).warning("system metrics of run %s not written: %s", getattr(
            monitor, "run_id", "?"), e)
