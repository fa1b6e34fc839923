"""Rejection sampling's shards on a Ray cluster: samples/s with 1 and with 2 Ray worker processes.

Starts a real Ray cluster on 127.0.0.1 (tests/helpers/ray_local.py: one node per worker, 1 CPU each), an MLflow server
and a temporary Prefect API, logs a tiny checkpoint (tests/helpers/answering.py), and runs the real rejection-sampling
stage flow with its shards on the cluster, into a fresh shard store each time. An unquoted one-shard run first warms
the page cache, compiled code and servers; then each round runs the stage once on a fresh cluster of each size, the
sizes taking turns to go first, and the round's ratio is 2 workers' samples/s over 1 worker's. The median of the rounds'
ratios is quoted, with their range: the machine's speed drifts between runs, and a ratio of two runs made minutes
apart is less exposed to it than a ratio of two medians taken over the whole benchmark. Each round also runs the
probe: the same shard work in plain processes (no Ray, Prefect or MLflow: load the checkpoint, sample shards), 1
and 2 at once, whose ratio is what this machine's two cores allow at best.
samples/s = sampled completions / the stage's wall time; shard-phase samples/s = the same over the wall time of the
shard tasks' subflow (worker start, model download and load included; data, plan and merge left out).

    PYTHONPATH=. .venv/bin/python benchmarks/ray_rejection.py [--prompts 64] [--shard-size 8] [--tokens 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
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


def stage_config(args, prompts: Path, address: str | None = None, store: str | None = None,
                 num_prompts: int | None = None):
    from answering import SMALL as small
    from grpo.configs.recipe import RejectionSamplingConfig

    return RejectionSamplingConfig.model_validate({
        "model": {"tiny": small.model_dump()},
        "data": {"source": str(prompts), "num_train": num_prompts or args.prompts, "num_heldout": 0},
        "rejection": {"samples_per_prompt": args.samples, "shard_size": args.shard_size,
                      "sampling": {"max_new_tokens": args.tokens}, "target_samples": 10_000,
                      "decontamination_ngram": 0, "judge_when": "never"},
        **({"cluster": {"ray_address": address, "shard_store": store}} if address else {})})


def shard_work(args, checkpoint: str, prompts: Path, first: int, start_at: float) -> None:
    """One probe process: load the checkpoint, wait for the common start, sample `--probe-shards` shards the way a
    shard task does (one torch thread, as Ray gives a 1-CPU task), print the work's start and end and its samples."""
    import torch

    from grpo.models import load_model_and_tokenizer
    from grpo.rejection import shards
    from grpo.sampling.local.backend import TransformersBackend

    torch.set_num_threads(1)
    cfg = stage_config(args, prompts)
    backend = TransformersBackend(*load_model_and_tokenizer(cfg.model.model_copy(update={"name_or_path": checkpoint})))
    table = pd.read_json(prompts, lines=True)
    plan = shards.plan_shards(table, cfg.rejection)
    time.sleep(max(0.0, start_at - time.time()))
    t0, samples = time.time(), 0
    for i in range(first, first + args.probe_shards):
        rows = shards.rows_of_shard(table, plan[i % len(plan)])
        samples += shards.process_shard(backend, rows, cfg.rejection, None, i).counts.generated
    print(json.dumps({"start": t0, "end": time.time(), "samples": samples}), flush=True)


def probe(args, checkpoint: str, prompts: Path, n: int) -> float:
    """Samples/s of `n` plain processes sampling side by side (no Ray, Prefect or MLflow): the ceiling for n workers."""
    start_at = time.time() + 20  # after every process has imported and loaded the model
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--probe-child",
                               json.dumps([checkpoint, str(prompts), k * args.probe_shards, start_at])],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for k in range(n)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a probe process failed (exit codes {[p.returncode for p in procs]}; its error is above)")
    times = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    seconds = max(t["end"] for t in times) - min(t["start"] for t in times)
    return sum(t["samples"] for t in times) / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--shard-size", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--probe-shards", type=int, default=4, help="shards each probe process samples (0: no probe)")
    ap.add_argument("--probe-child", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (1 worker, 2 workers); the median ratio "
                                                          "is quoted")
    args = ap.parse_args()
    if args.probe_child:
        shard_work(args, *json.loads(args.probe_child))
        return
    home = Path(tempfile.mkdtemp(prefix="r1-bench-ray-"))
    os.environ["R1_HOME"] = str(home)
    os.environ["PREFECT_HOME"] = str(home / "prefect")

    from mlflow import MlflowClient
    from prefect.testing.utilities import prefect_test_harness

    from flows.cli import stack
    from flows.rejection_sampling import rejection_sampling
    from answering import train_answering_checkpoint
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
    workers = [int(w) for w in args.workers.split(",")]

    def run_stage(n: int, address: str, store: str, num_prompts: int | None = None) -> dict:
        cfg = stage_config(args, prompts, address, store, num_prompts)
        load0 = os.getloadavg()[0]
        t = time.perf_counter()
        result = rejection_sampling(checkpoint, cfg)
        seconds = time.perf_counter() - t
        generated = result.metrics["rejection/generated"]
        shards_s = shard_phase_seconds()
        return {"seconds": round(seconds, 2), "samples": generated, "samples_per_s": round(generated / seconds, 2),
                "shard_phase_s": round(shards_s, 2), "shard_phase_samples_per_s": round(generated / shards_s, 2),
                "load_avg_1min": [round(load0, 2), round(os.getloadavg()[0], 2)]}

    try:
        with prefect_test_harness(server_startup_timeout=180):
            for rnd in range(-1, args.rounds):  # round -1: a one-shard warm-up run, not quoted
                for n in (workers[:1] if rnd < 0 else workers if rnd % 2 == 0 else workers[::-1]):
                    key = "warmup" if rnd < 0 else f"{n}_workers_round{rnd}"
                    cluster = LocalRayCluster(root / f"c{n}-{rnd + 1}").start(n_nodes=n).wait_ready()
                    try:
                        results["runs"][key] = run_stage(n, cluster.address, f"file://{root}/store-{key}",
                                                         args.shard_size if rnd < 0 else None)
                    finally:
                        cluster.stop()
                    print(json.dumps({key: results["runs"][key]}), flush=True)
                if rnd >= 0 and args.probe_shards:
                    for n in workers:
                        results["runs"][f"probe_{n}_round{rnd}"] = {"samples_per_s": round(
                            probe(args, ckpt, prompts, n), 2)}
                        print(json.dumps({f"probe_{n}_round{rnd}": results["runs"][f"probe_{n}_round{rnd}"]}),
                              flush=True)
    finally:
        stack.stop_process(mlflow)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    runs = results["runs"]
    if len(workers) == 2:
        lo, hi = workers
        for name, key in (("stage", "samples_per_s"), ("shards", "shard_phase_samples_per_s"),
                          ("probe", "samples_per_s")):
            pre = "probe_{}_round{}" if name == "probe" else "{}_workers_round{}"
            pairs = [(runs.get(pre.format(hi, r)), runs.get(pre.format(lo, r))) for r in range(args.rounds)]
            ratios = [a[key] / b[key] for a, b in pairs if a and b]
            if ratios:
                results[f"speedup_{hi}_vs_{lo}_{name}"] = {"median": round(statistics.median(ratios), 2),
                                                           "min": round(min(ratios), 2),
                                                           "max": round(max(ratios), 2),
                                                           "rounds": [round(x, 2) for x in ratios]}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    import signal

    # a kill (timeout, Ctrl-C) unwinds through main's `finally`s: the cluster and servers stop with the benchmark
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
