"""Asynchronous GRPO under random faults: sampler processes paused, paused and continued, or killed at moments
nobody chose, many times over. Every run must finish, with no sampler process left behind.

usage: python benchmarks/rollout_chaos.py [--runs 20] [--steps 60] [--seed 10] [--timeout-s 3]

Each run trains `--steps` steps of the embedded recipe's tiny shape (2 layers, hidden 64; 8 prompts, 2 a step, 4
samples each, 12 new tokens) with `rollout.mode: async`, its `max_staleness` (0, 1 or 2) and worker count (1 or
2) drawn from the run's seed, `timeout_s` from the command and no limit on restarts. Beside it a thread waits
0.05-1 s, picks one of the live sampler processes and sends it SIGSTOP (half the time), SIGSTOP then SIGCONT after
0-3 s (a quarter) or SIGKILL (a quarter), again until the run ends. One JSON line a run (seconds, faults sent,
restarts the trainer logged, processes left), then the count of runs that finished.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path


def samplers() -> list:
    return [p for p in mp.active_children() if p.name.startswith("r1-rollout")]


def chaos(stop: threading.Event, rng: random.Random, sent: list) -> None:
    while not stop.wait(rng.uniform(0.05, 1.0)):
        live = samplers()
        if not live:
            continue
        p, what = rng.choice(live), rng.choice(["stop", "stop", "stop-cont", "kill"])
        try:
            os.kill(p.pid, signal.SIGKILL if what == "kill" else signal.SIGSTOP)
            if what == "stop-cont":
                time.sleep(rng.uniform(0.0, 3.0))
                os.kill(p.pid, signal.SIGCONT)
            sent.append(what)
        except ProcessLookupError:
            pass  # it ended (or was replaced) in between


def one(seed: int, steps: int, timeout_s: float) -> dict:
    import pandas as pd
    import torch

    from grpo.config import GRPOConfig, SamplingConfig, TinyModelConfig
    from grpo.rollout_config import RolloutConfig
    from grpo.tiny import build_tiny_model, build_tokenizer
    from grpo.training.loops.grpo_trainer import GRPOTrainer

    rng = random.Random(seed)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1), tok)
    prompts = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})
    rollout = RolloutConfig(mode="async", max_staleness=rng.choice([0, 1, 2]), workers=rng.choice([1, 2]), threads=1,
                            timeout_s=timeout_s, max_restarts=10_000)
    cfg = GRPOConfig(max_steps=steps, prompts_per_step=2, num_generations=4, checkpoint_every=0,
                     sampling=SamplingConfig(max_new_tokens=12, temperature=0.9), rewards={"digits": 1.0},
                     mixed_precision="no", rollout=rollout)
    seen: dict[int, dict] = {}
    stop, sent = threading.Event(), []
    thread = threading.Thread(target=chaos, args=(stop, rng, sent), daemon=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model, tok, prompts, cfg, out, progress=False,
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
    time.sleep(0.5)
    return {"seed": seed, "max_staleness": rollout.max_staleness, "workers": rollout.workers,
            "finished": error is None and sorted(seen) == list(range(1, steps + 1)), "error": error,
            "seconds": round(time.monotonic() - t0, 1), "faults": len(sent),
            **{k: sent.count(k) for k in ("stop", "stop-cont", "kill")},
            "restarts": seen.get(steps, {}).get("async/restarts"), "left": [p.pid for p in samplers()]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=10)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch

    torch.set_num_threads(1)
    rows = []
    for seed in range(args.seed, args.seed + args.runs):
        rows.append(one(seed, args.steps, args.timeout_s))
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"runs": len(rows), "finished": sum(r["finished"] and not r["left"] for r in rows),
                      "faults": sum(r["faults"] for r in rows)}))


if __name__ == "__main__":
    main()
