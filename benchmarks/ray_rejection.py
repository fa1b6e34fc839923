"""Rejection sampling's shards on a Ray cluster: samples/s with 1 and with 2 Ray worker processes.

Starts a real Ray cluster on 127.0.0.1 (tests/ray_local.py: one node per worker, 1 CPU each), an MLflow server and a
temporary Prefect API, logs a tiny checkpoint (tests/answering.py), and runs the real rejection-sampling stage flow
with its shards on the cluster, into a fresh shard store each time. Each cluster size runs the stage twice (the
first warms the nodes' page cache and compiled code; workers are started per run either way); compare the second.
samples/s = sampled completions / the stage's wall time; shard-phase samples/s = the same over the wall time of the
shard tasks' subflow (worker start, model download and load included; data, plan and merge left out).

    PYTHONPATH=. .venv/bin/python benchmarks/ray_rejection.py [--prompts 64] [--shard-size 8] [--tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
_HOME = Path(tempfile.mkdtemp(prefix="r1-bench-ray-"))
os.environ["R1_HOME"] = str(_HOME)
os.environ["PREFECT_HOME"] = str(_HOME / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pandas as pd  # noqa: E402


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
                platform.processor())


def shard_phase_seconds() -> float:
    """Wall time of the latest `rejection_sampling_shards` subflow run: the shard tasks on the cluster, from
    connecting to Ray to the last shard (the stage's data, plan and merge steps left out)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        (run,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rejection_sampling_shards"])),
                                       sort=FlowRunSort.START_TIME_DESC, limit=1)
    return (run.end_time - run.start_time).total_seconds()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--shard-size", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()

    from mlflow import MlflowClient
    from prefect.testing.utilities import prefect_test_harness

    from flows import stack
    from flows.rejection_sampling import rejection_sampling
    from answering import SMALL as small
    from answering import train_answering_checkpoint
    from grpo.recipe import RejectionSamplingConfig
    from ray_local import LocalRayCluster

    root = Path(tempfile.mkdtemp(prefix="r1ray-", dir="/tmp"))
    # a model that answers "1" (the tests' answering checkpoint), so the rule check keeps rows: an empty curated
    # set is not what a real run merges
    ckpt = train_answering_checkpoint(root / "answering")
    prompts = root / "prompts.jsonl"
    pd.DataFrame({"prompt": [f"Problem {i}: what is it?" for i in range(args.prompts)],
                  "answer": ["1"] * args.prompts}).to_json(prompts, orient="records", lines=True)
    mlflow, uri = stack.start_mlflow_server(root / "mlflow.db", root / "artifacts", stack.free_port(), root)
    os.environ["MLFLOW_TRACKING_URI"] = uri
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("bench-ray")).info.run_id
    client.log_artifacts(run, ckpt, "checkpoint")
    checkpoint = f"runs:/{run}/checkpoint"
    results = {"cpu": cpu_model(), "cores": os.cpu_count(), "args": vars(args), "runs": {}}
    try:
        with prefect_test_harness(server_startup_timeout=180):
            for n in [int(w) for w in args.workers.split(",")]:
                cluster = LocalRayCluster(root / f"c{n}").start(n_nodes=n).wait_ready()
                try:
                    for attempt in range(2):
                        cfg = RejectionSamplingConfig.model_validate({
                            "model": {"tiny": small.model_dump()},
                            "data": {"source": str(prompts), "num_train": args.prompts, "num_heldout": 0},
                            "rejection": {"samples_per_prompt": args.samples, "shard_size": args.shard_size,
                                          "sampling": {"max_new_tokens": args.tokens}, "target_samples": 10_000,
                                          "decontamination_ngram": 0, "judge_when": "never"},
                            "cluster": {"ray_address": cluster.address,
                                        "shard_store": f"file://{root}/store-{n}-{attempt}"}})
                        load0 = os.getloadavg()[0]
                        t = time.perf_counter()
                        result = rejection_sampling(checkpoint, cfg)
                        seconds = time.perf_counter() - t
                        generated = result.metrics["rejection/generated"]
                        shards_s = shard_phase_seconds()
                        results["runs"][f"{n}_workers_run{attempt}"] = {
                            "seconds": round(seconds, 2), "samples": generated,
                            "samples_per_s": round(generated / seconds, 2), "shard_phase_s": round(shards_s, 2),
                            "shard_phase_samples_per_s": round(generated / shards_s, 2),
                            "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}
                        print(json.dumps({f"{n} workers, run {attempt}": results["runs"][f"{n}_workers_run{attempt}"]}),
                              flush=True)
                finally:
                    cluster.stop()
    finally:
        stack.stop_process(mlflow)
        shutil.rmtree(root, ignore_errors=True)
    runs = results["runs"]
    if "1_workers_run1" in runs and "2_workers_run1" in runs:
        for key in ("samples_per_s", "shard_phase_samples_per_s"):
            results[f"speedup_2_vs_1_{key}"] = round(runs["2_workers_run1"][key] / runs["1_workers_run1"][key], 2)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    import signal

    # a kill (timeout, Ctrl-C) unwinds through main's `finally`s: the cluster and servers stop with the benchmark
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
