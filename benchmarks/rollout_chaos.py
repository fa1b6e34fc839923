"""Asynchronous GRPO under random faults: sampler processes paused, paused and continued, or killed at moments
nobody chose, many times over. Every run must finish, with no sampler process left behind.

usage: python benchmarks/rollout_chaos.py [--runs 20] [--steps 60] [--seed 10] [--timeout-s 3] [--launcher ray]

Each run trains `--steps` steps of the embedded recipe's tiny shape (2 layers, hidden 64; 8 prompts, 2 a step, 4
samples each, 12 new tokens) with `rollout.mode: async`, its `max_staleness` (0, 1 or 2) and worker count (1 or
2) drawn from the run's seed, `timeout_s` from the command and no limit on restarts. Beside it a thread waits
0.05-1 s, picks one of the live sampler processes and sends it SIGSTOP (half the time), SIGSTOP then SIGCONT after
0-3 s (a quarter) or SIGKILL (a quarter), again until the run ends. One JSON line a run (seconds, faults sent,
restarts the trainer logged, processes left), then the count of runs that finished.

`--launcher ray`: the samplers are Ray actors (`rollout.launcher: ray`) on a one-node Ray cluster of 4 CPUs on
127.0.0.1 that the benchmark starts (tests/helpers/ray_local.py) and stops; the faults go to the actors' processes
(their pids as the trainer knows them), and "left" counts the actors' processes still alive after each run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path


def samplers() -> list[int]:
    """The sampler processes of this process (the process launcher)."""
    return [p.pid for p in mp.active_children() if p.name.startswith("r1-rollout")]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def chaos(stop: threading.Event, rng: random.Random, sent: list, targets) -> None:
    while not stop.wait(rng.uniform(0.05, 1.0)):
        live = targets()
        if not live:
            continue
        pid, what = rng.choice(live), rng.choice(["stop", "stop", "stop-cont", "kill"])
        try:
            os.kill(pid, signal.SIGKILL if what == "kill" else signal.SIGSTOP)
            if what == "stop-cont":
                time.sleep(rng.uniform(0.0, 3.0))
                os.kill(pid, signal.SIGCONT)
            sent.append(what)
        except ProcessLookupError:
            pass  # it ended (or was replaced) in between


def one(seed: int, steps: int, timeout_s: float, ray_address: str | None = None) -> dict:
    import pandas as pd
    import torch

    from grpo.configs.model import TinyModelConfig
    from grpo.configs.rollout import RolloutConfig
    from grpo.configs.sampling import SamplingConfig
    from grpo.configs.training import GRPOConfig
    from grpo.tiny import build_tiny_model, build_tokenizer
    from grpo.training.loops.grpo_trainer import GRPOTrainer

    rng = random.Random(seed)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1), tok)
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})
    rollout = RolloutConfig(mode="async", max_staleness=rng.choice([0, 1, 2]), workers=rng.choice([1, 2]), threads=1,
                            timeout_s=timeout_s, max_restarts=10_000,
                            **({"launcher": "ray", "ray_address": ray_address} if ray_address else {}))
    cfg = GRPOConfig(max_steps=steps, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                     sampling=SamplingConfig(max_new_tokens=12, temperature=0.9), rewards={"digits": 1.0},
                     mixed_precision="no", rollout=rollout)
    seen: dict[int, dict] = {}
    stop, sent, held, actors = threading.Event(), [], {}, set()

    def targets() -> list[int]:  # the live samplers: processes of ours, or the trainer's actors' processes
        if not ray_address:
            return samplers()
        workers = getattr(getattr(held.get("trainer"), "source", None), "rollouts", None)
        pids = [a.pid for a in (getattr(workers, "workers", None) or []) if a is not None and a.pid]
        actors.update(pids)
        return [p for p in pids if alive(p)]

    thread = threading.Thread(target=chaos, args=(stop, rng, sent, targets), daemon=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        trainer = held["trainer"] = GRPOTrainer(model, tok, prompts, cfg, out, progress=False,
                                                reward_functions={"digits": lambda completions, **_: [
                                                    float(sum(ch.isdigit() for ch in c)) for c in completions]},
                                                on_metrics=lambda step, m: seen.__setitem__(step, m))
        thread.start()
        error = None
        try:
            trainer.train()
        except Exception as e:  # noqa: BLE001 - the line says what it was
            error = f"{type(e).__name__}: {e}"
        finally:
            stop.set()
            thread.join()
    deadline = time.monotonic() + (10.0 if ray_address else 0.5)  # Ray ends a killed actor's process itself
    while time.monotonic() < deadline and leftover(actors, ray_address):
        time.sleep(0.2)
    return {"seed": seed, "max_staleness": rollout.max_staleness, "workers": rollout.workers,
            "finished": error is None and sorted(seen) == list(range(1, steps + 1)), "error": error,
            "seconds": round(time.monotonic() - t0, 1), "faults": len(sent),
            **{k: sent.count(k) for k in ("stop", "stop-cont", "kill")},
            "restarts": seen.get(steps, {}).get("async/restarts"), "left": leftover(actors, ray_address)}


def leftover(actors: set[int], ray_address: str | None) -> list[int]:
    return sorted(p for p in actors if alive(p)) if ray_address else samplers()


@contextlib.contextmanager
def ray_cluster():
    """A one-node Ray cluster on 127.0.0.1 (4 CPUs: two sampler actors and room to replace them), stopped after."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.pop("RAY_ADDRESS", None)
    from ray_local import LocalRayCluster

    root = Path(tempfile.mkdtemp(prefix="r1ray-", dir="/tmp"))  # short: Ray's unix socket paths live under it
    cluster = LocalRayCluster(root / "c", cpus_per_node=4).start(n_nodes=1)
    try:
        cluster.wait_ready()
        yield cluster.address
    finally:
        import ray

        ray.shutdown()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--launcher", choices=["process", "ray"], default="process")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "tests" / "helpers")]
    import torch

    torch.set_num_threads(1)
    rows = []
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(ray_cluster()) if args.launcher == "ray" else None
        for seed in range(args.seed, args.seed + args.runs):
            rows.append(one(seed, args.steps, args.timeout_s, address))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"runs": len(rows), "finished": sum(r["finished"] and not r["left"] for r in rows),
                      "faults": sum(r["faults"] for r in rows)}))


if __name__ == "__main__":
    main()
