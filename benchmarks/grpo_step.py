"""GRPO step speed and memory with the project's trainer on a shared-bench workload (the TRL peers' twin).

usage: python benchmarks/grpo_step.py MODEL_DIR [--workload PATH] [--gradient-checkpointing] [--device auto|cpu|cuda]
                                      [--smoke] [--lora R] [--weights-dtype float32|bfloat16] [--memory-at-peak PATH]
MODEL_DIR comes from the shared bench's make_tiny_model.py (CPU workloads: workload.json, workload_wide.json) or
gpu/make_model.py (the GPU workload, gpu/workload.json): a random-weight Qwen2 model, its tokenizer, prompts.jsonl.
Prints, as its last line, the JSON figures the peers print: median step seconds, completion tokens per second
(mean completion length x completions per step / step time, per step, median), peak RSS in MiB, and on CUDA the
peak CUDA memory in GiB (`torch.cuda.max_memory_allocated`, as gpu/trl_peer.py); then the median seconds of the
step's three parts: sampling and scoring, reference log-probs, policy update.
Same hyperparameters and reward as the peers; the timed step is the whole step: sampling, scoring, reference
log-probs, loss, backward and optimizer step (its last `.item()` waits for the GPU). The workload's
`micro_batch_size` (else the whole batch) is the micro-batch; on CUDA the forward and backward run under bf16
autocast over float32 weights, as the GPU workload's `precision` says (TRL's bf16=True); on CPU in float32.
`--gradient-checkpointing` recomputes each layer in the backward, as TRL 1.16's GRPOTrainer does by default (the
peers leave its default on). `--device cpu` runs on the CPU even where a GPU is (`--smoke` cuts the workload to 2
steps of 2 prompts x 4 completions x 16 tokens, to check the path runs, not to time it).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.json"


def sum_reward(completions, answer, **_):
    """1.0 when the completion holds the sum, plus the fraction of its characters that are digits (the peers')."""
    return [(1.0 if a in c else 0.0) + sum(ch.isdigit() for ch in c) / max(len(c), 1)
            for c, a in zip(completions, answer)]


def load_workload(args):
    """The workload's model, prompts and GRPO settings, read the way every side of a comparison reads them.

    Returns (cuda, the workload's `grpo` section, completions a step, prompt rows, model, tokenizer, GRPOConfig).
    """
    import pandas as pd
    import torch

    from grpo.configs.lora import LoRAConfig
    from grpo.configs.model import ModelConfig
    from grpo.configs.sampling import SamplingConfig
    from grpo.configs.training import GRPOConfig
    from grpo.models import load_model_and_tokenizer

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        sys.exit("--device cuda: torch sees no CUDA device here")
    spec = json.loads(Path(args.workload).read_text())
    g = dict(spec["grpo"])
    if args.smoke:
        g.update(steps=2, warmup_steps_excluded_from_timing=1, prompts_per_step=2, num_generations=4,
                 max_completion_length=16, micro_batch_size=min(g.get("micro_batch_size", 8), 4))
    torch.manual_seed(spec["seed"])
    rows = pd.read_json(Path(args.model_dir) / "prompts.jsonl", lines=True, dtype={"answer": str})
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=args.model_dir))
    if tok.chat_template is None:  # the workload's prompts are plain text, as TRL feeds them
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    n = g["prompts_per_step"] * g["num_generations"]
    bf16 = cuda and "bf16" in spec.get("precision", "")
    cfg = GRPOConfig(
        max_steps=g["steps"], prompts_per_step=g["prompts_per_step"], num_generations=g["num_generations"],
        sampling=SamplingConfig(max_new_tokens=g["max_completion_length"], temperature=g["temperature"],
                                batch_size=n),  # the whole step's completions in one batch, as TRL samples them
        learning_rate=g["learning_rate"], beta=g["beta"], epsilon=g["epsilon"], num_iterations=g["num_iterations"],
        rewards={"sum": 1.0}, checkpoint_every=0, samples_every=0, seed=spec["seed"],
        micro_batch_size=g.get("micro_batch_size", n), gradient_checkpointing=args.gradient_checkpointing,
        mixed_precision="bf16" if bf16 else "no",
        lora=LoRAConfig(r=args.lora) if getattr(args, "lora", None) else None,
        weights_dtype=getattr(args, "weights_dtype", "float32"),
    )
    return cuda, g, n, rows, model, tok, cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA where there is a GPU; cpu hides the GPUs from this process")
    ap.add_argument("--smoke", action="store_true", help="a cut-down workload that checks the path runs")
    ap.add_argument("--lora", type=int, default=None, metavar="R",
                    help="train rank-R LoRA adapters on every linear layer instead of the whole model (needs peft)")
    ap.add_argument("--weights-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="bfloat16: bf16 weights with fp32 master copies in the optimizer")
    ap.add_argument("--memory-at-peak", metavar="PATH",
                    help="on CUDA: record every allocation and write to PATH (JSON) what held the memory at its peak, "
                         "by the line of the project that asked for it")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the trainer then finds no GPU

    import torch

    from grpo.training.loops.grpo_trainer import GRPOTrainer

    cuda, g, n, rows, model, tok, cfg = load_workload(args)
    steps: list[dict] = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        if args.memory_at_peak:
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    with tempfile.TemporaryDirectory() as out:
        GRPOTrainer(model, tok, rows, cfg, out, reward_functions={"sum": sum_reward}, progress=False,
                    on_metrics=lambda step, m: steps.append(m)).train()
    timed = steps[g["warmup_steps_excluded_from_timing"]:]
    figures = {
        "system": "r1-pipeline",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "median_step_s": round(statistics.median(m["time/step_s"] for m in timed), 4),
        "completion_tokens_per_s": round(statistics.median(m["completion_length"] * n / m["time/step_s"]
                                                           for m in timed), 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "mean_completion_length": round(statistics.mean(m["completion_length"] for m in steps), 2),
        "micro_batch_size": cfg.memory.micro_batch_size,
        "mixed_precision": cfg.memory.mixed_precision,
        "gradient_checkpointing": cfg.memory.gradient_checkpointing,
        "lora_r": cfg.lora.r if cfg.lora else None,
        "weights_dtype": cfg.memory.weights_dtype,
        # where the step goes (medians; not in the peers' figures)
        **{f"median_{k}_s": round(statistics.median(m[f"time/{k}_s"] for m in timed), 4)
           for k in ("generation", "reference", "optimise")},
    }
    if cuda:
        figures["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if args.memory_at_peak:
            Path(args.memory_at_peak).write_text(json.dumps(memory_at_peak(torch.cuda.memory._snapshot()), indent=1))
            torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps(figures))


def memory_at_peak(snapshot: dict, top: int = 15) -> dict:
    """From a recorded snapshot (`torch.cuda.memory._snapshot()`): the moment the allocated bytes peaked, and the
    allocations alive then, summed by the innermost frame of the project (else of transformers or torch) that asked
    for them, largest first (GiB)."""
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])
    held = {}
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            held[e["addr"]] = e
        elif e["action"] in ("free_requested", "free_completed"):
            held.pop(e["addr"], None)
    groups: dict[str, int] = {}
    for e in held.values():
        groups[_asker(e.get("frames") or [])] = groups.get(_asker(e.get("frames") or []), 0) + e["size"]
    order = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"peak_gib": round(peak / 2**30, 3), "events": len(events),
            "by_asker_gib": {k: round(v / 2**30, 3) for k, v in order[:top]},
            "rest_gib": round(sum(v for _, v in order[top:]) / 2**30, 3)}


def _asker(frames: list[dict]) -> str:
    """The innermost frame in the project's code (grpo/, runtime/, tasks/, benchmarks/), else in transformers, peft or
    torch.optim, as 'file:line function'."""
    for marks in (("/grpo/", "/runtime/", "/tasks/", "/benchmarks/"), ("/transformers/", "/peft/", "/torch/optim/")):
        for f in frames:
            name = f.get("filename", "")
            if any(m in name for m in marks):
                mark = next(m for m in marks if m in name)
                short = mark.strip('/') + '/' + name.split(mark)[-1]
                return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no frame: CUDA init, the allocator, or C++)"


if __name__ == "__main__":
    sys.exit(main())
