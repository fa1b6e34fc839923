"""PPO with a critic against GRPO on one shared-bench workload, in turns in one run: peak memory and step time.

usage: python benchmarks/ppo_vs_grpo.py MODEL_DIR [--workload PATH] [--pairs 2] [--device auto|cpu|cuda]
                                        [--gradient-checkpointing] [--smoke]
       python benchmarks/ppo_vs_grpo.py MODEL_DIR --only grpo|ppo [...]   (one side in this process)

The claim measured: GRPO drops PPO's critic, a model as large as the policy, and saves its memory and compute.
MODEL_DIR comes from the shared bench's make_tiny_model.py (CPU: workload.json) or gpu/make_model.py (GPU:
gpu/workload.json). Each side runs in its own process (`--only`), so each has its own peak: RSS on CPU
(`ru_maxrss`), `torch.cuda.max_memory_allocated` on CUDA. Pairs alternate which side goes first, so drift in the
machine's speed falls on both; the summary is the median over pairs of PPO / GRPO.

Both sides take the workload's hyperparameters, reward and precision exactly as benchmarks/grpo_step.py does (bf16
autocast over float32 weights on CUDA where the workload says so, float32 on CPU). At equal budget PPO samples one
completion for each of prompts_per_step x num_generations prompts: the same completions a step as GRPO, each of its
own prompt. PPO runs with its defaults (a separate critic copied from the policy, GAE gamma 1, lambda 0.95, value
clip 0.2, vf_coef 0.1, the workload's beta as a k1 KL penalty in the rewards). The timed step is the whole step:
sampling, scoring, reference (and for PPO pi_old and value) passes, loss, backward, optimizer step(s); the median of
the steps after the workload's warm-up. Beside it, `median_step_cpu_s`: the side's CPU seconds a step (all its
threads), which other jobs on a shared machine move less than wall time. Prints one JSON line per side and pair, a
Markdown table, and a JSON summary as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from grpo_step import DEFAULT_WORKLOAD, load_workload, sum_reward

ALGORITHMS = ("grpo", "ppo")
MEMORY_LABELS = {"peak_rss_mib": "RSS MiB", "peak_cuda_gib": "CUDA GiB"}


def run_one(algorithm: str, args) -> dict:
    """Train one side on the workload in this process; its figures."""
    import torch

    from grpo.configs.ppo import PPOConfig
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from grpo.training.loops.ppo_trainer import PPOTrainer

    cuda, g, n, rows, model, tok, cfg = load_workload(args)  # n: completions a step, for both
    steps: list[dict] = []
    cpu_marks: list[float] = []  # the process's CPU seconds at the end of each step: less moved by other jobs

    def on_metrics(step: int, m: dict) -> None:
        steps.append(m)
        cpu_marks.append(time.process_time())

    kwargs = dict(reward_functions={"sum": sum_reward}, progress=False, on_metrics=on_metrics)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        if algorithm == "ppo":
            trainer = PPOTrainer(model, tok, rows, cfg, out, ppo=PPOConfig(), **kwargs)
            critic_params = sum(p.numel() for p in trainer.critic.parameters())
        else:
            trainer = GRPOTrainer(model, tok, rows, cfg, out, **kwargs)
            critic_params = 0
        policy_params = sum(p.numel() for p in trainer.model.parameters())
        trainer.train()
    warmup = g["warmup_steps_excluded_from_timing"]
    timed = steps[warmup:]
    cpu_steps = [b - a for a, b in zip(cpu_marks[warmup - 1:], cpu_marks[warmup:])] if warmup else []
    figures = {
        "algorithm": algorithm,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "median_step_s": round(statistics.median(m["time/step_s"] for m in timed), 4),
        "median_step_cpu_s": round(statistics.median(cpu_steps), 4) if cpu_steps else None,  # all threads' CPU time
        **{f"median_{k}_s": round(statistics.median(m[f"time/{k}_s"] for m in timed), 4)
           for k in ("generation", "reference", "optimise")},
        "completion_tokens_per_s": round(statistics.median(m["completion_length"] * n / m["time/step_s"]
                                                           for m in timed), 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "prompts_per_step": n if algorithm == "ppo" else g["prompts_per_step"],
        "completions_per_step": n,
        "mean_completion_length": round(statistics.mean(m["completion_length"] for m in steps), 2),
        "policy_params": policy_params,
        "critic_params": critic_params,
        "mixed_precision": cfg.memory.mixed_precision,
        "gradient_checkpointing": cfg.memory.gradient_checkpointing,
    }
    if cuda:
        figures["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return figures


def run_side(algorithm: str, args) -> dict:
    """One side in a fresh process, so that its peak memory is its own."""
    cmd = [sys.executable, __file__, args.model_dir, "--only", algorithm, "--workload", args.workload,
           "--device", args.device] + ["--gradient-checkpointing"] * args.gradient_checkpointing + ["--smoke"] * args.smoke
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(lines[-1])


def table(runs: dict[str, list[dict]], memory: str) -> str:
    """Medians over the pairs, one row per algorithm, in Markdown."""
    head = ("| algorithm | prompts x completions a step | step s | step CPU s | sampling + scoring s "
            f"| ref, pi_old, values s | update s | peak {MEMORY_LABELS[memory]} | trained parameters |\n"
            "|---|---|---|---|---|---|---|---|---|")
    rows = []
    for algo, figs in runs.items():
        med = {k: statistics.median(f[k] for f in figs) for k in figs[0] if isinstance(figs[0][k], (int, float))}
        per_prompt = med["completions_per_step"] // med["prompts_per_step"]
        rows.append(f"| {algo} | {int(med['prompts_per_step'])} x {int(per_prompt)} | {med['median_step_s']:.3f} "
                    f"| {med.get('median_step_cpu_s', float('nan')):.3f} "
                    f"| {med['median_generation_s']:.3f} | {med['median_reference_s']:.3f} "
                    f"| {med['median_optimise_s']:.3f} | {med[memory]:,.1f} "
                    f"| {int(med['policy_params'] + med['critic_params']):,} |")
    return "\n".join([head, *rows])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD))
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--only", choices=ALGORITHMS, help="run one side in this process and print its figures")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA where there is a GPU; cpu hides the GPUs from the sides")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward")
    ap.add_argument("--smoke", action="store_true", help="a cut-down workload that checks the path runs")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported (and inherited by the sides)
    if args.only:
        print(json.dumps(run_one(args.only, args)))
        return
    runs: dict[str, list[dict]] = {a: [] for a in ALGORITHMS}
    ratios: dict[str, list[float]] = {}
    for pair in range(args.pairs):
        order = ALGORITHMS if pair % 2 == 0 else ALGORITHMS[::-1]  # who goes first alternates
        figs = {algo: run_side(algo, args) for algo in order}
        print(json.dumps(figs), flush=True)
        for algo in ALGORITHMS:
            runs[algo].append(figs[algo])
        for k in ("median_step_s", "median_step_cpu_s", "completion_tokens_per_s", "peak_rss_mib", "peak_cuda_gib"):
            if figs["grpo"].get(k):
                ratios.setdefault(k, []).append(figs["ppo"][k] / figs["grpo"][k])
    memory = "peak_cuda_gib" if "peak_cuda_gib" in runs["grpo"][0] else "peak_rss_mib"
    print(table(runs, memory))
    print(json.dumps({"device": runs["grpo"][0]["device"], "pairs": args.pairs,
                      **{f"ppo_over_grpo_{k}": round(statistics.median(v), 3) for k, v in ratios.items()}}))


if __name__ == "__main__":
    sys.exit(main())
