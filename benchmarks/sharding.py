"""What each training process holds, and what a GRPO step costs, under `distributed.strategy` ddp and fsdp.

    .venv/bin/python benchmarks/sharding.py                # both parts, one JSON line each
    .venv/bin/python benchmarks/sharding.py --part state   # model-state bytes a process, ~50M parameters
    .venv/bin/python benchmarks/sharding.py --part step    # one GRPO step, ddp against fsdp, 2 processes

`state`: a Qwen2-shaped model of ~50M parameters takes one AdamW step through the strategy's `prepare`, then each
process counts the bytes it holds in parameters, gradients and optimizer state (its own shards under fsdp; DDP's
gradient buckets counted apart, as they are extra), at 1 and 2 processes, for ddp and fsdp (fp32 throughout).
`step`: GRPOTrainer on the GRPO bench's model shape (hidden 256, 4 layers) on 2 processes, 8 prompts x 8
completions of up to 64 tokens a step, the median `time/step_s` of steps 2..N for each strategy in one run (fsdp
twice: `reshard_after_forward` on, the default, and off).
Every process is a real one under `torchrun` on 127.0.0.1 (gloo on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n: int, *args: str) -> list[dict]:
    """Run this file's worker on `n` processes; the JSON lines rank 0 printed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, "--worker", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker_state(strategy: str) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.configs.distributed import DistributedConfig
    from grpo.training.accelerator import make_accelerator
    from grpo.training.optimizers import make_adamw
    from grpo.training.strategy import make_strategy

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    acc = make_accelerator("no")
    dist = make_strategy(acc, DistributedConfig(strategy=strategy))
    optimizer = make_adamw(model, 1e-4, 0.0)
    model, optimizer = dist.prepare(model, optimizer)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    inner = getattr(optimizer, "optimizer", optimizer)
    held = {"parameters": sum(_local_bytes(p) for p in model.parameters()),
            "gradients": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optimizer": sum(_local_bytes(v) for s in inner.state.values() for v in s.values()
                             if torch.is_tensor(v) and v.dim())}
    reducer = getattr(model, "reducer", None)  # DDP's flat buckets, beside the gradients unless they are views
    held["ddp_buckets"] = 0 if reducer is None else held["gradients"] * (not model.gradient_as_bucket_view)
    if acc.is_main_process:
        print(json.dumps({"strategy": strategy, "processes": acc.num_processes, "parameters": params,
                          **{f"{k}_mib": round(v / 2**20, 1) for k, v in held.items()},
                          "model_state_mib": round(sum(v for k, v in held.items() if k != "ddp_buckets") / 2**20, 1),
                          "with_buckets_mib": round(sum(held.values()) / 2**20, 1)}), flush=True)


def worker_step(strategy: str, steps: int) -> None:
    import pandas as pd
    import torch

    from grpo.configs.distributed import DistributedConfig
    from grpo.configs.model import ModelConfig, TinyModelConfig
    from grpo.configs.sampling import SamplingConfig
    from grpo.configs.training import GRPOConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.grpo_trainer import GRPOTrainer

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=TinyModelConfig(hidden_size=256, intermediate_size=688,
                                                                           num_hidden_layers=4)))
    prompts = pd.DataFrame({"prompt": [f"Count from {i} to {i + 9}." for i in range(64)]})
    cfg = GRPOConfig(max_steps=steps, prompts_per_step=8, num_generations=8, micro_batch_size=32,
                     learning_rate=1e-5, beta=0.04, rewards={"length": 1.0}, checkpoint_every=0, log_every=1,
                     samples_every=0, mixed_precision="no", sampling=SamplingConfig(max_new_tokens=64))
    seen = {}

    def record(step, metrics):
        seen[step] = metrics

    def length(completions, **_):
        return [len(c) / 100 for c in completions]

    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model, tok, prompts, cfg, out, on_metrics=record, reward_functions={"length": length},
                              progress=False, distributed=DistributedConfig(
                                  strategy="fsdp" if strategy.startswith("fsdp") else strategy,
                                  fsdp={"reshard_after_forward": strategy != "fsdp-keep"}))
        trainer.train()
        if trainer.acc.is_main_process:
            times = [seen[s]["time/step_s"] for s in sorted(seen)[1:]]  # the first step warms up
            print(json.dumps({"strategy": strategy, "processes": trainer.acc.num_processes,
                              "median_step_s": round(statistics.median(times), 4),
                              "steps": [round(t, 3) for t in times],
                              "split_s": {k: round(statistics.median(seen[s][f"time/{k}_s"] for s in sorted(seen)[1:]), 4)
                                          for k in ("generation", "reference", "optimise")}}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["state", "step", "all"], default="all")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        part, strategy = args.worker[:2]
        return worker_state(strategy) if part == "state" else worker_step(strategy, args.steps)
    if args.part in ("state", "all"):
        rows = {(s, n): launch(n, "state", s)[0] for s in ("ddp", "fsdp") for n in (1, 2)}
        for row in rows.values():
            print(json.dumps({"part": "state", **row}))
        ratio = rows[("fsdp", 2)]["model_state_mib"] / rows[("ddp", 2)]["model_state_mib"]
        print(json.dumps({"part": "state", "fsdp2_over_ddp2_model_state": round(ratio, 3),
                          "fsdp2_over_ddp2_with_buckets": round(rows[("fsdp", 2)]["with_buckets_mib"]
                                                                / rows[("ddp", 2)]["with_buckets_mib"], 3)}))
    if args.part in ("step", "all"):
        # fsdp-keep: fsdp with reshard_after_forward off (a unit's gathered weights kept from forward to backward)
        rows = {s: launch(2, "step", s, "--steps", str(args.steps))[0] for s in ("ddp", "fsdp", "fsdp-keep")}
        for row in rows.values():
            print(json.dumps({"part": "step", **row}))
        print(json.dumps({"part": "step", **{f"{s}_over_ddp_step_time": round(rows[s]["median_step_s"]
                                                                              / rows["ddp"]["median_step_s"], 3)
                                             for s in ("fsdp", "fsdp-keep")}}))


if __name__ == "__main__":
    main()
