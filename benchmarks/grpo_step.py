"""GRPO step speed on ../shared/bench/workload.json with the project's trainer (the TRL peer's twin).

usage: python benchmarks/grpo_step.py MODEL_DIR [--workload PATH] [--gradient-checkpointing]
MODEL_DIR comes from the shared bench's make_tiny_model.py (a tiny random Qwen2 model, tokenizer, prompts.jsonl).
Prints, as its last line, the JSON figures the peer prints: median step seconds, completion tokens per second
(mean completion length x completions per step / step time, per step, median), peak RSS in MiB; then the median
seconds of the step's three parts: sampling and scoring, reference log-probs, policy update.
Same hyperparameters and reward as the peer; the timed step is the whole step: sampling, scoring, reference
log-probs, loss, backward and optimizer step. `--gradient-checkpointing` recomputes each layer in the backward, as
TRL 1.16's GRPOTrainer does by default (the peer leaves its default on).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

from grpo.config import GRPOConfig, ModelConfig, SamplingConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.grpo_trainer import GRPOTrainer

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench" / "workload.json"


def sum_reward(completions, answer, **_):
    """1.0 when the completion holds the sum, plus the fraction of its characters that are digits (the peer's)."""
    return [(1.0 if a in c else 0.0) + sum(ch.isdigit() for ch in c) / max(len(c), 1)
            for c, a in zip(completions, answer)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward")
    args = ap.parse_args()
    spec = json.loads(Path(args.workload).read_text())
    g = spec["grpo"]
    torch.manual_seed(spec["seed"])
    rows = pd.read_json(Path(args.model_dir) / "prompts.jsonl", lines=True, dtype={"answer": str})
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=args.model_dir))
    if tok.chat_template is None:  # the workload's prompts are plain text, as TRL feeds them
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    cfg = GRPOConfig(
        max_steps=g["steps"], prompts_per_step=g["prompts_per_step"], num_generations=g["num_generations"],
        sampling=SamplingConfig(max_new_tokens=g["max_completion_length"], temperature=g["temperature"]),
        learning_rate=g["learning_rate"], beta=g["beta"], epsilon=g["epsilon"], num_iterations=g["num_iterations"],
        rewards={"sum": 1.0}, checkpoint_every=0, samples_every=0, seed=spec["seed"],
        micro_batch_size=g["prompts_per_step"] * g["num_generations"],
        gradient_checkpointing=args.gradient_checkpointing,
    )
    steps: list[dict] = []
    with tempfile.TemporaryDirectory() as out:
        GRPOTrainer(model, tok, rows, cfg, out, reward_functions={"sum": sum_reward}, progress=False,
                    on_metrics=lambda step, m: steps.append(m)).train()
    skip = g["warmup_steps_excluded_from_timing"]
    n = g["prompts_per_step"] * g["num_generations"]
    timed = steps[skip:]
    print(json.dumps({
        "system": "r1-pipeline",
        "median_step_s": round(statistics.median(m["time/step_s"] for m in timed), 4),
        "completion_tokens_per_s": round(statistics.median(m["completion_length"] * n / m["time/step_s"]
                                                           for m in timed), 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "mean_completion_length": round(statistics.mean(m["completion_length"] for m in steps), 2),
        # where the step goes (medians; not in the peer's figures)
        **{f"median_{k}_s": round(statistics.median(m[f"time/{k}_s"] for m in timed), 4)
           for k in ("generation", "reference", "optimise")},
    }))


if __name__ == "__main__":
    sys.exit(main())
