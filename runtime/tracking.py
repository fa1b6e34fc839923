"""MLflow plumbing shared by every stage: where tracking lives, runs by explicit id, params, metrics, datasets.

MLflow's active run is thread-local and Prefect runs tasks in worker threads, so nothing here relies on
`mlflow.start_run()`: every call names its run id through an `MlflowClient`.

Where things go:
- `MLFLOW_TRACKING_URI` when set (a team's `mlflow server`), else `sqlite:///<R1_HOME>/mlflow.db` with artifacts
  under `<R1_HOME>/mlartifacts` (the embedded default);
- `R1_HOME` when set, else `.r1/` at the project root.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import warnings
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import DatasetInput, InputTag, Metric, Param
from pydantic import BaseModel

from grpo.faults import DISK_FULL, MIN_FREE, Fault, disk_fault, disk_full_line, file_size_limit, free_bytes
from grpo.interrupts import signals_deferred
from grpo.training.checkpoints import NO_MANIFEST, verify_manifest, write_manifest
from runtime import env, store_copies
from runtime.env import home_path
from runtime.home import reroot_embedded_store

DEFAULT_EXPERIMENT = "r1-pipeline"
# the experiment's kind, "Machine learning" (runs, metrics, models) rather than GenAI (traces), for the MLflow 3
# UIs that open an experiment on the view its kind names. 3.17's UI reads no tag for it (its own GenAI / Model
# training switch decides), which is why the links below name their view themselves
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def r1_home() -> Path:
    home = home_path()
    home.mkdir(parents=True, exist_ok=True)
    return home


def embedded_uri() -> str:
    """The embedded default's store, in R1_HOME (made here)."""
    r1_home()
    return env.embedded_uri()


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or embedded_uri()


_ready: set[str] = set()  # SQLite stores this process has opened (and so created, if they were new)


class _RetryingClient:
    """An MlflowClient whose calls are made again while SQLite says the database is locked.

    SQLite answers "locked" at once, whatever its busy timeout, when a transaction that has read must write while
    another thread of the process holds the write lock; a background thread's write (a heartbeat, a resume
    checkpoint's mark, system metrics) can meet the loop's own that way. The failed transaction was rolled back, so
    making the call again is safe.
    """

    def __init__(self, inner: MlflowClient):
        self._inner = inner

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: retry_locked(attr, *args, **kwargs)


def client() -> MlflowClient:
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)  # so mlflow.artifacts / mlflow.data helpers resolve runs:/ URIs the same way
    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    if uri in _ready:
        return _RetryingClient(MlflowClient(tracking_uri=uri))  # type: ignore[return-value]
    # a stop signal that lands inside a read of the store raises there, and SQLAlchemy then fails to close the
    # cursor of a database already closed and prints that second error with its traceback ("Error closing cursor"):
    # the first error is the stop, which ends the run KILLED with its one line; the pool's own errors say no more
    logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
    # two processes opening a new database at once (two `r1 run` on a fresh home) race in MLflow's schema
    # migration and one fails with "table ... already exists": open it one process at a time
    import fcntl

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if uri == embedded_uri():  # the embedded store, whose home may have moved (runtime.home)
            reroot_embedded_store(db, r1_home())
        store_copies.seed_mlflow(db)  # a new database: from the migrated copy, not by every migration
        c = MlflowClient(tracking_uri=uri)
        c.search_experiments(max_results=1)  # creates the tracking tables
        c.search_registered_models(max_results=1)  # and the registry's
    _ready.add(uri)
    return _RetryingClient(c)  # type: ignore[return-value]


def experiment_id(name: str | None = None) -> str:
    """The experiment's id, created on first use (with a local artifact folder in the embedded default)."""
    name = name or os.environ.get("R1_EXPERIMENT", DEFAULT_EXPERIMENT)
    c = client()
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if "mlflow.experimentKind" not in exp.tags:  # made before the kind was set; a kind someone chose stays
            for key, value in EXPERIMENT_KIND.items():
                c.set_experiment_tag(exp.experiment_id, key, value)
        return exp.experiment_id
    location = None
    if tracking_uri().startswith("sqlite:"):  # a local store: keep artifacts beside it, not in the working folder
        location = (r1_home() / "mlartifacts").as_uri()
    try:
        return c.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    except mlflow.exceptions.MlflowException:  # another thread or process created it first
        return c.get_experiment_by_name(name).experiment_id


def flatten(config: BaseModel | dict, prefix: str = "") -> dict[str, str]:
    """`{"train": {"learning_rate": 0.001}}` -> `{"train.learning_rate": "0.001"}`: a config as MLflow params."""
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = str(value)
    return out


def owner_tags() -> dict[str, str]:
    """Which process owns a run while it is RUNNING: host, pid and the process's start time (pids are reused)."""
    import psutil

    return {"r1.host": socket.gethostname(), "r1.pid": str(os.getpid()),
            "r1.process_started": f"{psutil.Process().create_time():.2f}"}


def _owner_alive(tags: dict[str, str]) -> bool:
    """Whether the process that owns a run on this host still runs (a pid now held by another process does not)."""
    import psutil

    try:
        started = psutil.Process(int(tags["r1.pid"])).create_time()
    except (psutil.NoSuchProcess, ValueError, KeyError):
        return False
    except psutil.AccessDenied:  # someone else's process: alive, and not ours to judge
        return True
    if "r1.process_started" not in tags:
        return True
    return abs(started - float(tags["r1.process_started"])) < 0.05


def end_dead_runs() -> list[str]:
    """Mark FAILED the runs left RUNNING by an r1 process that has ended (killed, crashed, its pod or node lost).

    A run owned by a process on this host is judged by asking for the process (host, pid, start time); a run from
    anywhere else by its heartbeat (runtime/heartbeat.py): one that stopped beating is dead. Returns the runs marked.
    """
    from runtime import heartbeat

    host = socket.gethostname()
    ended = []
    for run in find_runs("attributes.status = 'RUNNING'"):
        tags = run.data.tags
        if tags.get("r1.host") == host and not _owner_alive(tags):
            why = f"process {tags.get('r1.pid')} on {host} ended without closing the run"
        elif tags.get("r1.host") != host and heartbeat.is_stale(tags):
            why = f"its heartbeat stopped (process {tags.get('r1.pid')} on {tags.get('r1.host')})"
        else:
            continue
        set_tags(run.info.run_id, {"r1.ended_because": why})
        end_run(run.info.run_id, "FAILED")
        ended.append(run.info.run_id)
    return ended


def _needs_heartbeat() -> bool:
    """Runs beat where the tracking store is shared (a server, a database): a local SQLite file serves one machine,
    whose processes `end_dead_runs` asks for directly, and a second writer thread there only adds lock waits."""
    return not tracking_uri().startswith("sqlite:")


def _write_heartbeat(run_id: str, epoch_ms: str) -> None:
    from runtime import heartbeat

    client().set_tag(run_id, heartbeat.TAG, epoch_ms)


SQLITE_FULL = "database or disk is full"  # SQLite's words for a write that found no room (SQLITE_FULL)
# and for one stopped at the process's file size limit (EFBIG is no ENOSPC to SQLite: SQLITE_IOERR_WRITE)
SQLITE_IOERR = "disk I/O error"


LOCKED_PATIENCE_S = 20.0  # how long a call waits out "database is locked": under a stop's 30 s, above a busy store's


def retry_locked(call, *args, patience_s: float = LOCKED_PATIENCE_S, **kwargs):
    """A tracking call, again after a short pause while SQLite says the database is locked (see _RetryingClient),
    for up to `patience_s` (processes side by side ending their runs at once, a sweep's points on Ctrl-C, met it
    for the 6-13 s eight tries gave); a `Fault` naming the store's disk where SQLite says it is full."""
    import random
    import time

    from mlflow.exceptions import MlflowException

    # a stop signal waits for a SQLite call's end: one stopped inside its transaction keeps the database locked
    # for the rest of the process (the run could not be ended KILLED); a call to a server may be stopped anywhere
    shield = signals_deferred if tracking_uri().startswith("sqlite:") else contextlib.nullcontext
    deadline = time.monotonic() + patience_s
    for attempt in itertools.count():
        try:
            with shield():
                return call(*args, **kwargs)
        except MlflowException as e:
            if _no_room(e) and tracking_uri().startswith("sqlite:///"):  # SQLite says so in words, with no errno
                db = Path(tracking_uri()[len("sqlite:///"):])
                raise (disk_fault(e, [db.parent], written=db)
                       or Fault(disk_full_line(db.parent, MIN_FREE, free_bytes(db.parent)))) from e
            if "database is locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(min(0.05 * 2 ** attempt, 1.0) * (1 + random.random()))  # apart, so they do not meet again


def start_run(name: str, *, tags: dict[str, str], parent_run_id: str | None = None,
              config: BaseModel | None = None) -> str:
    """Create a run (nested under `parent_run_id` if given), log the config as params, return its id."""
    from runtime import heartbeat

    c = client()
    beats = _needs_heartbeat()
    all_tags = {**tags, **owner_tags(), **(heartbeat.first_beat() if beats else {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = c.create_run(experiment_id(), run_name=name, tags=all_tags)
    if beats:
        heartbeat.beat_for(run.info.run_id, _write_heartbeat)  # until it ends
    if config is not None:
        log_params(run.info.run_id, flatten(config))
    return run.info.run_id


def log_params(run_id: str, params: dict[str, Any]) -> None:
    items = [Param(k, str(v)) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
        client().log_batch(run_id, params=items[i : i + 100])


def end_run(run_id: str, status: str = "FINISHED") -> None:
    from runtime import heartbeat, outage

    heartbeat.stop_beating(run_id)
    outage.flush(run_id)  # its queued metrics first: a tracking server that did not answer may be back
    uri = tracking_uri()
    if uri.startswith(("http://", "https://")) and not outage.answering(uri):  # not minutes of the client's retries
        raise outage.away(uri, run_id, status)
    client().set_terminated(run_id, status=status)


def end_run_if_room(run_id: str, status: str) -> bool:
    """End a run that stops on an error, unless the store's disk has no room left for it or its tracking server does
    not answer: then it stays RUNNING until the next start marks it FAILED (`end_dead_runs`, as for a killed
    process), and False is returned."""
    from runtime.outage import ServerAway

    try:
        end_run(run_id, status)
    except ServerAway:
        return False
    except Exception as e:
        if not _no_room(e):
            raise
        return False
    return True


def _no_room(e: BaseException) -> bool:
    """Whether `e` comes from a write that found its disk full or met the file size limit (SQLite's words, or
    a disk-full errno)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if SQLITE_FULL in str(e) or (isinstance(e, OSError) and e.errno in DISK_FULL):
            return True
        if SQLITE_IOERR in str(e) and file_size_limit() is not None:
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


class MetricsLogger:
    """A metrics callback for `grpo` loops: `logger(step, {"train/loss": 0.1})` writes one batch to the run; to a
    tracking server through a queue (`runtime.outage`), so training goes on while the server does not answer."""

    def __init__(self, run_id: str):
        from runtime import outage

        uri = tracking_uri()
        self.run_id, self.client = run_id, client()
        self.queue = outage.queue_for(uri, outage.write_once) if uri.startswith(("http://", "https://")) else None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v == v]  # drop NaN
        if not batch:
            return
        if self.queue is not None:
            self.queue.put(self.run_id, batch)
        else:
            self.client.log_batch(self.run_id, metrics=batch)


# MLflow's advice, whenever it infers a schema, on a model signature's integer columns: a dataset input or a table
# of samples is no model signature
INTEGER_HINT = "Hint: Inferred schema contains integer column"


def log_dataset(run_id: str, df: pd.DataFrame, *, name: str, source: str, context: str) -> None:
    """Record `df` as a dataset input of the run (MLflow's Datasets tab), with a digest that tells versions apart."""
    shown = df.copy()
    for col in shown.columns:  # chat messages are lists, some columns mix None and text: MLflow's schema wants
        if shown[col].dtype == object:  # one scalar type per column (and an empty frame cannot be inferred)
            shown[col] = shown[col].astype(str)
    dataset = None
    with warnings.catch_warnings():
        # mlflow registers its local-file source for two schemes ("" and "file"), so every local path matches it
        # twice and it warns that the source is ambiguous: both are the same class
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple")
        warnings.filterwarnings("ignore", message=INTEGER_HINT)
        if "://" in source or _is_local_path(source):  # a URI or a local file MLflow knows how to describe
            with contextlib.suppress(mlflow.exceptions.MlflowException):  # a scheme it has no source for (runs:/)
                dataset = mlflow.data.from_pandas(shown, source=source, name=name)
        if dataset is None:  # generated in code (the synthetic task, a run's output) or a hub name: not a path here
            from mlflow.data.code_dataset_source import CodeDatasetSource

            dataset = mlflow.data.from_pandas(shown, source=CodeDatasetSource(tags={"source": source}), name=name)
        inp = DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])
    log_input(run_id, inp)


def log_input(run_id: str, inp: DatasetInput) -> None:
    """Record a dataset input of the run."""
    for attempt in range(3):
        try:
            return client().log_inputs(run_id, datasets=[inp])
        except mlflow.exceptions.MlflowException as e:
            # MLflow looks the dataset up, then inserts it: two runs of one recipe logging the same data at once
            # both find none and the second insert breaks the digest's uniqueness; again, it finds the first's row
            if "UNIQUE constraint failed: datasets." not in str(e) or attempt == 2:
                raise


def _is_local_path(source: str) -> bool:
    """Whether `source` names a file or folder here (a name too long or odd for a path is not one)."""
    try:
        return Path(source).exists()
    except (OSError, ValueError):
        return False


def log_table(run_id: str, df: pd.DataFrame, artifact_file: str) -> None:
    """`df` as MLflow's `log_table` writes a table (JSON, "split"), its own file (the same name again replaces it).
    MLflow lists a run's tables in one tag for its UI, and cuts the tag at 8,000 characters: its next `log_table`
    then fails on the cut list (the 150th table; a GRPO run logging samples every 25 steps died near step 3,750).
    Here the tag lists the tables while they fit; the later ones are files in the same format, unlisted."""
    from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS
    from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

    folder, name = os.path.split(artifact_file)
    with tempfile.TemporaryDirectory() as tmp:
        df.to_json(Path(tmp) / name, orient="split", index=False, date_format="iso")
        client().log_artifact(run_id, str(Path(tmp) / name), folder or None)
    try:
        listed = json.loads(client().get_run(run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
    except json.JSONDecodeError:  # cut by an earlier writer: left as it is
        return
    entry = {"path": artifact_file, "type": "table"}
    if entry not in listed and len(value := json.dumps([*listed, entry])) <= MAX_TAG_VAL_LENGTH:
        client().set_tag(run_id, MLFLOW_LOGGED_ARTIFACTS, value)


def log_text(run_id: str, text: str, artifact_file: str) -> None:
    """`text` as the run's artifact file `artifact_file` (a report a person reads beside the metrics)."""
    client().log_text(run_id, text, artifact_file)


def log_dir(run_id: str, local_dir: str | Path, artifact_path: str) -> str:
    """Upload a folder as an artifact and return its `runs:/` URI, the handle the next stage takes. The folder
    travels with a manifest of its files (sizes, checksums), which `download` checks."""
    write_manifest(local_dir)
    client().log_artifacts(run_id, str(local_dir), artifact_path)
    return f"runs:/{run_id}/{artifact_path}"


def log_frame(run_id: str, df: pd.DataFrame, artifact_path: str, filename: str = "data.parquet") -> str:
    """Write `df` as Parquet under an artifact folder and return the folder's `runs:/` URI."""
    with tempfile.TemporaryDirectory() as tmp:
        df.to_parquet(Path(tmp) / filename)
        return log_dir(run_id, tmp, artifact_path)


def download(uri: str, dst: str | Path | None = None) -> Path:
    """A `runs:/`, `models:/` or other artifact URI as a local path; a plain local path is returned as is.

    A run's artifacts never change once logged, so `runs:/` downloads are kept under R1_HOME/downloads and
    reused: a stage that loads the same checkpoint three times (evaluate, train, evaluate) copies it once. A
    registered final model (`models:/<name>@<alias>`, an MLflow transformers model) comes back as a folder
    `from_pretrained` reads, as a checkpoint does.
    """
    if Path(uri).exists():
        return _verified(Path(uri), uri, checksums=False)  # a local folder: sizes only, as it may be large
    if "://" not in uri and not uri.startswith(("runs:", "models:")):
        raise FileNotFoundError(f"{uri!r} is neither a local path nor an MLflow artifact URI")
    client()
    if dst is None and uri.startswith("runs:/"):
        store = "embedded" if tracking_uri() == embedded_uri() else tracking_uri()  # the same after a move
        key = hashlib.sha256(f"{store} {uri}".encode()).hexdigest()[:16]
        cached = r1_home() / "downloads" / key
        done = cached / ".complete"
        if done.exists() and verify_manifest(cached / done.read_text(), checksums=False) not in (None, NO_MANIFEST):
            shutil.rmtree(cached, ignore_errors=True)  # the local copy was cut short since: fetched again
        if not done.exists():
            # downloaded aside and renamed into place: two processes fetching the same checkpoint (two pipelines
            # reusing one stage) never see or remove each other's half-written copy
            cached.parent.mkdir(parents=True, exist_ok=True)
            part = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f"{key}.part-"))
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(part)))
            try:
                _verified(local, uri)
            except Fault:
                shutil.rmtree(part, ignore_errors=True)
                raise
            (part / ".complete").write_text(str(local.relative_to(part)))
            if cached.exists() and not done.exists():  # a half copy an older version of this code left
                shutil.rmtree(cached, ignore_errors=True)
            try:
                os.rename(part, cached)
            except OSError:  # another process put a complete copy there first
                shutil.rmtree(part, ignore_errors=True)
        return cached / done.read_text()
    dst = Path(dst or tempfile.mkdtemp(prefix="r1-artifact-"))
    dst.mkdir(parents=True, exist_ok=True)
    return pretrained_folder(_verified(Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst))),
                                       uri))


def _verified(local: Path, uri: str, checksums: bool = True) -> Path:
    """`local`, once its files match the manifest it was logged with (outputs logged without one pass as they are)."""
    problem = verify_manifest(local, checksums=checksums) if local.is_dir() else None
    if problem not in (None, NO_MANIFEST):
        # `r1 stage` alone would write it in a new run, but `r1 run` would still reuse the damaged one: --fresh
        raise Fault(f"{uri} is damaged: {problem}; the store lost or cut part of it, so the stage that wrote it "
                    f"must run again: add --fresh to the same `r1 run`")
    return local


def pretrained_folder(local: Path) -> Path:
    """`local` as a folder `from_pretrained` reads: an MLflow transformers model (the registered final model) keeps
    its weights in `model/` and its tokenizer in `components/tokenizer/`, which are copied in beside the weights."""
    import yaml

    mlmodel = local / "MLmodel"
    if not mlmodel.is_file():
        return local
    flavor = (yaml.safe_load(mlmodel.read_text()) or {}).get("flavors", {}).get("transformers")
    if not flavor:
        return local
    weights = local / flavor.get("model_binary", "model")
    for component in flavor.get("components", []):
        for item in (local / "components" / component).iterdir():
            if item.is_file() and not (weights / item.name).exists():
                shutil.copy2(item, weights / item.name)
    return weights


def set_tags(run_id: str, tags: dict[str, str]) -> None:
    c = client()
    for k, v in tags.items():
        c.set_tag(run_id, k, v)


def find_runs(filter_string: str) -> list:
    """Runs of the experiment matching an MLflow search filter, newest first."""
    return client().search_runs([experiment_id()], filter_string, order_by=["attributes.start_time DESC"])


def reopen_run(run_id: str) -> None:
    """Mark a failed run RUNNING again, for a retry that carries on in it (owned by this process now)."""
    from runtime import heartbeat

    set_tags(run_id, {**owner_tags(), **(heartbeat.first_beat() if _needs_heartbeat() else {})})
    client().update_run(run_id, status="RUNNING")
    if _needs_heartbeat():
        heartbeat.beat_for(run_id, _write_heartbeat)


def pipeline_uris(run_id: str) -> dict[str, str]:
    """The URIs an earlier pipeline run's stages produced (its `uri.<name>` tags), to start a rerun from."""
    tags = client().get_run(run_id).data.tags
    uris = {k[len("uri."):]: v for k, v in tags.items() if k.startswith("uri.")}
    if not uris:
        raise ValueError(f"MLflow run {run_id} records no stage URIs (uri.* tags): is it a pipeline run?")
    return uris
