"""Reasoning GRPO with process supervision against outcome supervision, from one cold-start checkpoint.

usage: python benchmarks/process_supervision.py [--recipe tiny] [--seeds 0 1 2] [--max-steps N] [--cold-start DIR]
                                                [--work DIR] [--step-verifier arithmetic|prm] [--prm DIR]

Trains the recipe's cold-start model once (or takes `--cold-start`, a model folder), then runs the recipe's
reasoning GRPO from it twice per seed: `supervision: outcome` (one reward per completion) and `supervision:
process` (the step verifier's reward at the end of every equation, the answer step rewarded with the outcome
reward), with everything else the recipe's (its budget unless `--max-steps`). Held-out figures, greedy, on the
recipe's reasoning_grpo held-out rows, before (the cold start) and after each run:
  accuracy       the answer is right (eval/accuracy of the stage)
  step accuracy  share of the reasoning's equations that hold, checked by the arithmetic step verifier
Prints one JSON line per run as it finishes, then a table with the means over the seeds. CPU figures: quote the
`lscpu` model name with them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def heldout_figures(model, tok, heldout, eval_cfg) -> dict[str, float]:
    """Greedy held-out accuracy and step accuracy (equations that hold, over all equations written)."""
    from grpo.configs.sampling import SamplingConfig
    from grpo.rewards import accuracy_reward
    from grpo.rewards.steps import arithmetic_steps
    from grpo.sampling.local.backend import TransformersBackend

    rows = heldout.head(eval_cfg.num_prompts) if eval_cfg.num_prompts else heldout
    prompts, answers = rows["prompt"].tolist(), [str(a) for a in rows["answer"]]
    rollout = TransformersBackend(model, tok).generate(
        prompts, 1, SamplingConfig(max_new_tokens=eval_cfg.max_new_tokens, temperature=0.0,
                                   batch_size=eval_cfg.batch_size))
    correct = [c or 0.0 for c in accuracy_reward(rollout.texts, answer=answers)]
    steps = [r for s in arithmetic_steps(rollout.texts, prompts=prompts) for r in s.rewards]
    return {"accuracy": sum(correct) / len(correct),
            "step_accuracy": sum(steps) / len(steps) if steps else float("nan"),
            "steps_per_answer": len(steps) / len(correct)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-steps", type=int, default=None, help="GRPO steps per run (default: the recipe's)")
    ap.add_argument("--cold-start", default=None, help="a cold-start model folder (default: train the recipe's)")
    ap.add_argument("--work", default=None, help="folder for checkpoints (default: a temporary one)")
    ap.add_argument("--step-verifier", default="arithmetic", choices=["arithmetic", "prm"])
    ap.add_argument("--prm", default=None, help="the process reward model's folder, for --step-verifier prm")
    args = ap.parse_args()

    import torch

    from grpo.configs.model import ModelConfig
    from grpo.configs.recipe import load_recipe
    from grpo.configs.training import GRPOConfig
    from grpo.data.tables import load_rl_data, load_sft_data
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.loops.sft_trainer import train_sft

    recipe = load_recipe(args.recipe)
    work = Path(args.work or tempfile.mkdtemp(prefix="process-bench-"))
    t0 = time.perf_counter()
    cold = args.cold_start
    if cold is None:
        cs = recipe.cold_start_sft
        model, tok = load_model_and_tokenizer(cs.model)
        cold = str(train_sft(model, tok, load_sft_data(cs.data)[0], cs.train, work / "cold_start",
                             progress=False).model_dir)
        print(f"cold start trained in {time.perf_counter() - t0:.0f} s: {cold}", file=sys.stderr)
    rg = recipe.reasoning_grpo
    train, heldout = load_rl_data(rg.data)
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=cold))
    before = heldout_figures(model, tok, heldout, rg.eval)
    print(json.dumps({"run": "cold_start", **before}), flush=True)

    step_verifiers = None
    if args.step_verifier == "prm":
        from grpo.training.loops.prm import prm_step_verifier

        step_verifiers = {"prm": prm_step_verifier(args.prm)}
    records = []
    for seed in args.seeds:
        for supervision in ("outcome", "process"):
            process = supervision == "process"
            cfg = GRPOConfig.model_validate({
                **rg.grpo.model_dump(), "seed": seed, "supervision": supervision,
                "step_verifier": args.step_verifier if process else None,
                "prm_path": args.prm if process and args.step_verifier == "prm" else None,
                "max_steps": args.max_steps or rg.grpo.max_steps, "checkpoint_every": 0, "samples_every": 0})
            model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=cold))
            torch.manual_seed(seed)
            seen: list[dict[str, float]] = []
            start = time.perf_counter()
            trainer = GRPOTrainer(model, tok, train, cfg, work / f"{supervision}_{seed}", progress=False,
                                  on_metrics=lambda step, m: seen.append(m), step_verifiers=step_verifiers)
            trainer.train()
            seconds = time.perf_counter() - start
            after = heldout_figures(trainer.acc.unwrap_model(trainer.model), tok, heldout, rg.eval)
            tail = seen[-25:]
            record = {"run": supervision, "seed": seed, "steps": cfg.max_steps, "minutes": round(seconds / 60, 2),
                      **{f"{k}_after": v for k, v in after.items()},
                      "batch_accuracy_last25": statistics.mean(m["reward/accuracy"] for m in tail)}
            if process:
                record["batch_step_accuracy_last25"] = statistics.mean(m["process/step_accuracy"] for m in tail)
                record["fallback_per_step"] = statistics.mean(m["process/fallback"] for m in seen)
            records.append(record)
            print(json.dumps(record), flush=True)

    print(f"\ncold start: held-out accuracy {before['accuracy']:.3f}, step accuracy {before['step_accuracy']:.3f}")
    print("| supervision | seed | accuracy before | accuracy after | step accuracy before | step accuracy after | "
          "minutes |")
    print("|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['run']} | {r['seed']} | {before['accuracy']:.3f} | {r['accuracy_after']:.3f} | "
              f"{before['step_accuracy']:.3f} | {r['step_accuracy_after']:.3f} | {r['minutes']:.1f} |")
    for supervision in ("outcome", "process"):
        rs = [r for r in records if r["run"] == supervision]
        acc = [r["accuracy_after"] for r in rs]
        step = [r["step_accuracy_after"] for r in rs]
        spread = lambda xs: f" ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else ""  # noqa: E731
        print(f"| {supervision}, mean of {len(rs)} | | {before['accuracy']:.3f} | {statistics.mean(acc):.3f}"
              f"{spread(acc)} | {before['step_accuracy']:.3f} | {statistics.mean(step):.3f}{spread(step)} | |")


if __name__ == "__main__":
    main()
