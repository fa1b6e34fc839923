"""Shard tasks on a Ray cluster (prefect-ray's RayTaskRunner): the checks that run before any shard is sampled.

A shard task on a Ray node needs nothing from the driver's disk: it reads the prompts and the checkpoint from the
MLflow tracking server (its artifact store, over HTTP), writes its Parquet shard to the recipe's shard store (an
fsspec URI), and reports its state to the driver's Prefect API. Each of those is checked here, so a wrong address
or an unwritable store is one clear error before anything is sampled, not a hang or an hour of lost work.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from grpo.configs.distributed import DistributedConfig, rollout_ray_address
from grpo.configs.recipe import RejectionSamplingConfig
from grpo.configs.rejection import ClusterConfig
from grpo.extras import require
from grpo.rejection import shards
from runtime import tracking
from runtime.env import LOCAL_API

CLUSTER_EXTRA = "pip install 'r1-pipeline[cluster]' (here and on every node)"

HINT = "start one with `ray start --head`, or fix rejection_sampling.cluster.ray_address (or $RAY_ADDRESS)"


def resolve_ray_address(address: str) -> str:
    """`address`, with "auto" replaced by $RAY_ADDRESS (prefect-ray would start a local Ray instead)."""
    if address != "auto":
        return address
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if not env:
        raise ValueError("ray_address is 'auto' but RAY_ADDRESS is not set; set it to the cluster's address "
                         "(host:port of the head, as `ray start --head` prints it)")
    return env


def check_ray_address(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds when no Ray cluster answers at `address` (host:port of the GCS, or ray://host:port).

    `ray.init` against an address nobody answers retries for many minutes while the flow sits in Running. A TCP
    connect is not proof either (a transparent proxy accepts any connection), so the GCS's gRPC health service
    is asked; the Ray client server (ray://) has none and answers "Method not found", which is proof enough.
    """
    addr = address.removeprefix("ray://")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r} is not host:port or ray://host:port")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(f"no Ray cluster at {address!r}: cannot connect to {host}:{port} ({e}); {HINT}") \
            from None
    import grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        health = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda _: b"",
                                     response_deserializer=lambda b: b)
        try:
            reply = health(None, timeout=timeout)
            why = None if reply == b"\x08\x01" else f"health check answered {reply!r}, not SERVING"
        except grpc.RpcError as e:
            client_server = address.startswith("ray://") and e.code() == grpc.StatusCode.UNIMPLEMENTED
            why = None if client_server else f"{e.code().name}: {e.details()}"
    if why:
        raise ConnectionError(f"no Ray cluster at {address!r}: {host}:{port} is not a Ray GCS ({why}); {HINT}")


def check_cluster(cfg: ClusterConfig, checkpoint_uri: str, shard_dir: str) -> str:
    """Everything a Ray run needs, checked on the driver before any shard; returns the resolved Ray address."""
    require(["ray", "prefect_ray"], "rejection_sampling.cluster.ray_address", CLUSTER_EXTRA)
    address = resolve_ray_address(cfg.ray_address)
    uri = tracking.tracking_uri()
    if not uri.startswith(("http://", "https://", "databricks")):
        raise ValueError(f"shard tasks on Ray read the prompts and the checkpoint from MLflow, but the tracking URI "
                         f"is {uri!r}, which only this machine can read; set MLFLOW_TRACKING_URI to a tracking "
                         f"server every node can reach (`mlflow server --serve-artifacts ...`)")
    if "://" not in checkpoint_uri and not checkpoint_uri.startswith(("runs:", "models:")):
        raise ValueError(f"checkpoint {checkpoint_uri!r} is a local path the Ray nodes cannot read; pass its MLflow "
                         f"URI (runs:/<run id>/checkpoint) or a URI every node can read")
    from prefect.settings import get_current_settings

    api = get_current_settings().api.url
    if not api or api == os.environ.get(LOCAL_API):  # none, or the one `r1` started for itself on 127.0.0.1
        raise ValueError("shard tasks on Ray report to the Prefect API, but this run has none (ephemeral mode): "
                         "set PREFECT_API_URL to a Prefect server the nodes can reach")
    check_ray_address(address)
    shards.check_writable(shard_dir)
    return address


def shard_gpus(cfg: RejectionSamplingConfig, node_gpus: list[float]) -> float:
    """GPUs each shard task asks Ray for, given the GPUs of each live node (`cluster.gpus_per_shard`).

    Ray makes a task's assigned GPUs its visible ones, so each shard loads its model onto a GPU of its own; a task
    that asks for none sees them all. Asking for more than any node has would leave the shards waiting forever, so
    that is an error here, before any shard is submitted.
    """
    wanted = cfg.cluster.gpus_per_shard
    loads_model = cfg.generation.backend == "local" or (
        cfg.judge is not None and cfg.judge.backend == "transformers" and cfg.rejection.judge_when != "never")
    if wanted == "auto":
        return 1.0 if loads_model and max(node_gpus, default=0) >= 1 else 0.0
    if wanted > max(node_gpus, default=0):
        raise ValueError(f"rejection_sampling.cluster.gpus_per_shard is {wanted:g}, but no node of the Ray cluster "
                         f"has that many GPUs (per node: {[f'{g:g}' for g in node_gpus]}): no shard task could ever "
                         f"start; lower it, or add GPU nodes (`ray start --num-gpus=N`)")
    return float(wanted)


def ray_task_runner(address: str):
    """prefect-ray's task runner on the cluster at `address`; its workers use this process's MLflow server."""
    from prefect_ray import RayTaskRunner

    env = {"MLFLOW_TRACKING_URI": tracking.tracking_uri()}
    return RayTaskRunner(address=address, init_kwargs={"runtime_env": {"env_vars": env}})


@contextlib.contextmanager
def ray_connected(address: str):
    """This process connected to the cluster at `address` (as prefect-ray's runner connects: its workers use this
    process's MLflow server), for work it hands to the cluster itself (the merge's reads); left as it was after."""
    import ray

    if ray.is_initialized():  # already connected (a caller's own session): used as it is
        yield
        return
    env = {"MLFLOW_TRACKING_URI": tracking.tracking_uri()}
    ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def shard_store_dir(store: str, stage: str, key: str) -> str:
    """The run's folder in the shard store: keyed like the local work folder, so a rerun resumes from it."""
    return f"{store.rstrip('/')}/{stage}/{key}" if "://" in store else str(Path(store) / stage / key)


def check_training_cluster(cfg: DistributedConfig, stage: str) -> str | None:
    """A training stage on Ray (`distributed.engine: ray`): its cluster's address, resolved and checked before any
    model loads (ray installed, the cluster answers and can give the workers, the shared folder is writable here);
    None for a stage that trains on this machine."""
    if cfg.engine != "ray":
        return None
    require(["ray", "ray.train"], f"{stage}.distributed.engine: ray", CLUSTER_EXTRA)
    if not cfg.ray_address:
        raise ValueError(f"{stage}.distributed.engine is ray but names no cluster: set distributed.ray_address, or "
                         f"rejection_sampling.cluster.ray_address in the recipe")
    address = resolve_ray_address(cfg.ray_address)
    check_ray_address(address)
    shared = Path(cfg.shared_dir)
    try:
        shared.mkdir(parents=True, exist_ok=True)
        probe = shared / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"probe")
        probe.unlink()
    except OSError as e:
        raise PermissionError(f"{stage}.distributed.shared_dir {str(shared)!r} is not writable here ({e}); it must "
                              f"be a folder this machine and every Ray node mount") from None
    from grpo.training.launchers.ray_train import check_ray_cluster

    check_ray_cluster(cfg, address)
    return address


def check_rollout_cluster(cfg, distributed: DistributedConfig, stage: str):
    """A GRPO stage's config with its Ray samplers' cluster (`grpo.rollout.launcher: ray`) resolved and checked
    reachable before any model loads: `rollout.ray_address`, else the cluster its Ray Train workers run on
    (`distributed.engine: ray`), else the recipe's; the config as given where its samplers are not on Ray."""
    rollout = cfg.rollout
    if not rollout.asynchronous or rollout.launcher != "ray":
        return cfg
    require(["ray"], f"{stage}.grpo.rollout.launcher: ray", CLUSTER_EXTRA)
    address = rollout_ray_address(rollout.ray_address, distributed.engine, distributed.ray_address, None)
    if not address:
        raise ValueError(f"{stage}.grpo.rollout.launcher is ray but names no cluster: set grpo.rollout.ray_address, "
                         f"or rejection_sampling.cluster.ray_address in the recipe")
    address = resolve_ray_address(address)
    check_ray_address(address)
    return cfg.model_copy(update={"rollout": rollout.model_copy(update={"ray_address": address})})
