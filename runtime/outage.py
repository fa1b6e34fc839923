"""A tracking server that stops answering does not stop training: metrics wait in a queue until it answers again.

With a tracking server (`MLFLOW_TRACKING_URI=http(s)://...`), `tracking.MetricsLogger` hands each batch to this
process's `MetricsQueue`, whose thread writes the batches in order. Before each write it asks the server's `/health`
with a short timeout, so no call of MLflow's client sits out its own minutes of retries. While the server does not
answer, the batches stay queued, training goes on, and one line says so and how long a run will wait for it when it
ends (`R1_TRACKING_WAIT_S`, 600 s by default). Ending a run (`tracking.end_run`) first waits for its queued batches:
written once the server is back, or, after the wait, a `Fault` line; the stage's local checkpoints stay, so the same
command resumes. A run ended while the server does not answer (asked with the same short timeout) is left RUNNING,
with a `Fault` line, rather than sit out the MLflow client's retries (minutes): the next start marks it FAILED, as
it does a killed process's. A local store (SQLite) is written directly, as before: it cannot go away.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Callable

from grpo.faults import Fault

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0  # a server that takes longer than this to say it is healthy counts as not answering
RETRY_EVERY_S = 1.0  # how often a server that did not answer is asked again
# writes one batch of a run's metrics to the server at the uri: `write_once`, or a stand-in
Writer = Callable[[str, str, list], None]
WRITE_TIMEOUT_S = 30  # one batch's write to a tracking server, tried once (the queue tries it again)


def write_once(uri: str, run_id: str, metrics: list) -> None:
    """One batch to the tracking server at `uri`, tried once within WRITE_TIMEOUT_S: the queue writes it again once
    the server answers. MLflow's client retries a server gone mid-write for minutes (7 tries, backoff up to 2
    minutes), unseen, with every later batch waiting behind the call: a server killed during a write left a stage's
    end waiting out R1_TRACKING_WAIT_S without the line that says the server is not answering."""
    import json

    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.proto_json_utils import message_to_json
    from mlflow.utils.rest_utils import http_request_safe

    body = message_to_json(LogBatch(run_id=run_id, metrics=[m.to_proto() for m in metrics]))
    http_request_safe(get_default_host_creds(uri), "/api/2.0/mlflow/runs/log-batch", "POST", json=json.loads(body),
                      max_retries=0, timeout=WRITE_TIMEOUT_S)


def wait_s() -> float:
    """How long ending a run waits for a tracking server that does not answer (`R1_TRACKING_WAIT_S`)."""
    return float(os.environ.get("R1_TRACKING_WAIT_S", "600"))


def answering(uri: str) -> bool:
    """Whether the tracking server at `uri` answers at all (any HTTP status counts: a proxy may not know /health)."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


class MetricsQueue(threading.Thread):
    """Metric batches on their way to one tracking server, in order, each written once."""

    def __init__(self, uri: str, write: Writer):
        super().__init__(name="r1-metrics", daemon=True)
        self.uri, self.write = uri, write
        self.pending: deque[tuple[str, list]] = deque()  # (run id, metrics), oldest first
        self.changed = threading.Condition()
        self.down_since: float | None = None

    def put(self, run_id: str, metrics: list) -> None:
        with self.changed:
            self.pending.append((run_id, metrics))
            self.changed.notify_all()

    def run(self) -> None:
        while True:
            with self.changed:
                while not self.pending:
                    self.changed.wait()
                run_id, metrics = self.pending[0]
            if not answering(self.uri):
                self._not_answering()
                time.sleep(RETRY_EVERY_S)
                continue
            try:
                self.write(self.uri, run_id, metrics)
            except Exception as e:  # noqa: BLE001 (MLflow's and requests' errors alike)
                if not answering(self.uri):  # gone while writing: the same batch again once it is back
                    continue
                log.error("metrics of run %s at step %s not written to %s: %s", run_id, metrics[0].step, self.uri, e)
            if self.down_since is not None:
                log.warning("the MLflow server at %s answers again after %.0f s; the queued metrics are written",
                            self.uri, time.monotonic() - self.down_since)
                self.down_since = None
            with self.changed:
                self.pending.popleft()
                self.changed.notify_all()

    def _not_answering(self) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning("the MLflow server at %s is not answering: metrics are queued and training goes on; a run "
                        "that ends waits up to %.0f s for it (R1_TRACKING_WAIT_S)", self.uri, wait_s())

    def flush(self, run_id: str, wait: float) -> None:
        """Return once none of `run_id`'s batches is queued; a `Fault` when the server has not answered for `wait`
        seconds while some still are."""
        deadline = time.monotonic() + wait
        with self.changed:
            while any(r == run_id for r, _ in self.pending):
                left = deadline - time.monotonic()
                if left <= 0:
                    queued = sum(len(m) for r, m in self.pending if r == run_id)
                    raise Fault(f"the MLflow server at {self.uri} did not answer for {wait:.0f} s "
                                f"(R1_TRACKING_WAIT_S): {queued} metrics of run {run_id} were not written. The "
                                f"stage's local checkpoints are kept: run the same command again once the server "
                                f"answers to resume")
                self.changed.wait(min(left, 1.0))


class ServerAway(Fault):
    """The tracking server did not answer when a run was to be ended: the run is left as it is (RUNNING; the next
    start marks it FAILED, its process gone) rather than wait out minutes of the client's retries."""


def away(uri: str, run_id: str, status: str) -> ServerAway:
    return ServerAway(f"the MLflow server at {uri} does not answer, so run {run_id} could not be marked {status} "
                      f"(the next run marks it FAILED). The stage's local checkpoints are kept: run the same command "
                      f"again once the server answers to resume")


_queues: dict[str, MetricsQueue] = {}
_lock = threading.Lock()


def queue_for(uri: str, write: Writer) -> MetricsQueue:
    """This process's queue to the server at `uri` (one a server), writing with `write` when it starts."""
    with _lock:
        q = _queues.get(uri)
        if q is None or not q.is_alive():
            q = _queues[uri] = MetricsQueue(uri, write)
            q.start()
        return q


def flush(run_id: str, wait: float | None = None) -> None:
    """Wait for `run_id`'s queued metrics on every server this process writes to (see `MetricsQueue.flush`)."""
    for q in list(_queues.values()):
        q.flush(run_id, wait_s() if wait is None else wait)
