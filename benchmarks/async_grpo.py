"""Reasoning GRPO on a long-tailed workload, synchronous against asynchronous rollouts (`grpo.rollout.mode`), the
same model, prompts, rewards and number of optimizer steps, each way in a process of its own, one after another.

usage: python benchmarks/async_grpo.py [--steps 8] [--budget 128] [--prompts-per-step 8] [--num-generations 8]
                                       [--staleness 1 2 4] [--learning-rate 1e-7] [--prompts 128] [--eos-scale 10]
                                       [--clock wall|cpu] [--reference trainer|sampler]

The ways (on a 2-core machine: both cores either way):
- **sync**: `rollout.mode sync`, one process, `torch.set_num_threads(2)`: each step samples, then trains.
- **async, max_staleness k** (one run for each k of `--staleness`): `rollout.mode async`, one rollout worker with
  `rollout.threads 1`, the trainer process at `torch.set_num_threads(1)`: sampler and trainer one core each, the
  worker sampling step s with weights at most k optimizer steps old while the trainer trains (`sync_every` 1).
  `--reference sampler` (`rollout.reference`): the worker also scores the KL term's reference log-probs of what it
  sampled, so the trainer's step loses its reference forward pass (sync computes it either way).

The workload (`benchmarks/continuous_batching.py`'s): the embedded recipe's model shape (Qwen2, hidden 256, 4
layers, 2.97M parameters, its 1,024-entry BPE tokenizer), freshly initialised with seed 0
(`grpo.tiny.build_tiny_model`), with the end token's output row scaled by `--eos-scale` (10), so completions end
anywhere from the first token to the budget; `--prompts` prompts `What is {a} + {b}?` through the tokenizer's chat
template, their sums in the `answer` column. GRPO (`GRPOConfig`): `--prompts-per-step` prompts x
`--num-generations` completions a step, temperature 1 (no top-k or top-p), at most `--budget` new tokens, 64
sequences decoded together, fp32 (`mixed_precision` "no", `fp32_gemm` "mkl"), beta 0.04, loss "grpo", micro-batches
of 32 rows packed, no checkpoints, AdamW at `--learning-rate` (1e-7). Rewards: the project's `accuracy` (its
`grpo.rewards` function, on the `answer` column; a random model almost never writes an `<answer>` block, so it scores
0 nearly everywhere) plus `digit_share`, the fraction of a completion's characters that are digits (a
length-independent rule, cheap, that a random model's groups do spread on, so the advantages are not all zero). The
async ways train with the decoupled objective (behaviour weight capped at `rollout.behaviour_cap` 2, on the
workers' log-probs); sync without one (`tis_cap` unset).

Why 1e-7: this model's ending hangs on the scaled end row, and an optimizer step moves it far. At GRPOConfig's 1e-5
the steps after the first sampled 75-86% of their completions at the 128-token budget (median 128): the workload is
no longer long-tailed. At 1e-6 it drifts to ~50-60% by the sixth step; at 1e-7 it stays at 30-44% a step, as at
1e-9 (no learning): every way then samples close to the same lengths (the same seeds, weights a few steps apart
hardly differ), so the ways do the same work and tokens/s compares them. The first step's prompts end sooner (16%
at the budget, median 16): one reason it is the warm-up.

Timing: `--steps` timed steps after one warm-up step (the first: for async, the workers' start; for both, the first
GEMM plans and allocations). The clock runs from the end of the warm-up step's metrics callback to the end of the
last step's. Each way prints one JSON line:
- `tokens`: completion tokens trained in the timed steps (every sampled completion's tokens, recorded from each
  step's rollout), `seconds` by `--clock`, `wall_s`, and `tokens_per_s` = tokens / seconds;
- sync: `sampling_share` = the timed steps' `time/generation_s` (sampling and scoring) / wall, `training_share` =
  their `time/reference_s` + `time/optimise_s` (reference log-probs; forward, backward, optimizer) / wall;
- async: `trainer_idle_share` = the timed steps' `async/trainer_idle_s` (the trainer waiting for groups) / wall and
  `trainer_busy_share` = 1 - that; `sampler_busy_share` = their `async/sampler_busy_s` (the worker's `generate`
  calls) / wall and `sampler_idle_share` = 1 - that, of which `sampler_weight_wait_share` = their
  `async/sampler_idle_s` (waiting for weights new enough) / wall; `staleness_mean` and `staleness_max`
  (`async/staleness_*`), `buffer_depth_mean` (`async/buffer_depth`: steps received beyond the one taken, at each take),
  `push_s` (`async/push_s`, summed: the trainer writing its weights to shared memory);
- `own_cores`: the way's CPU seconds (its processes', as `--clock cpu` counts them) / wall, and `other_cores`: the
  rest of the machine's busy CPU seconds in the same window (/proc/stat) / wall: what other processes took, 0 on a
  quiet machine;
- `lengths`: the completion lengths' percentiles and the share at the budget, over the timed steps.
The samplers start on the timed steps during the warm-up step's training (up to max_staleness steps ahead), so the
first timed steps can find their groups already sampled: a head start of at most one step's training, which the
sampler shares count (their busy seconds are the timed steps' units', wherever they were sampled).

Each way's line ends with the load averages as its process began and ended: on a shared machine they say which ways
ran beside something else. The first line names the CPU (`lscpu`'s model name, family and model, whether
`avx512_bf16` is among its flags), the cores and the load average; the last compares each async way's tokens/s with
the sync run's of the same invocation, with the load average again.

`--clock cpu` times with CPU time instead of the wall clock: the trainer process's and its rollout workers' (read
from /proc while they live, from the reaped children's usage after), so async's figure is what the work costs in
all, overlap not counted: its overhead (a second copy of the model, the workers' log-probs, pickling, weight
pushes) against sync. The shares are against the wall clock either way. Neither clock makes a shared machine quiet:
the sync way's two threads meet at a barrier after every op, so a neighbour on one core stalls both (each op waits
for the descheduled thread, and the waiting thread's spinning is CPU time too), where the async ways' one-thread
processes only lose that core's share. Measured here: the sync way at 61 s a step beside one busy process, 3.3 s
quiet; the async ways 4.0-4.4 s beside it. Compare runs whose `other_cores` is near 0 (the load averages count
the way's own processes too: about 2 for either way on its own).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_header() -> dict:
    """The machine: lscpu's model name, family and model, the avx512_bf16 flag, the cores, the load average."""
    fields = {}
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    flags = fields.get("Flags", "")
    if not flags and Path("/proc/cpuinfo").exists():
        flags = next((ln.split(":", 1)[1] for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), "")
    return {"cpu": fields.get("Model name", "unknown"), "family": fields.get("CPU family"),
            "model": fields.get("Model"), "avx512_bf16": "avx512_bf16" in flags.split(),
            "avx512f": "avx512f" in flags.split(), "cores": len(os.sched_getaffinity(0)), "loadavg": loadavg()}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def workload(args):
    """The model (end token's output row scaled), its tokenizer, and the prompts with their answers."""
    import pandas as pd
    import torch

    from grpo.configs.model import TinyModelConfig
    from grpo.tiny import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(), tok)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= args.eos_scale  # tied: the embedding row too (never an input)
    pairs = [(10 + i % 90, 20 + (7 * i) % 70) for i in range(args.prompts)]
    prompts = pd.DataFrame({"prompt": [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in pairs],
                            "answer": [str(a + b) for a, b in pairs]})
    return model, tok, prompts


def digit_share(completions, **_):
    """The fraction of a completion's characters that are digits (0 for an empty one): independent of its length."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


class CpuClock:
    """CPU seconds of this process and of its children: the live rollout workers' read from /proc/PID/stat (a
    finished, unreaped one's too), the reaped ones' from getrusage. A child's seconds move from the first to the
    second when it is reaped, so the sum runs on."""

    def __init__(self):
        self.pids: set[int] = set()
        self.tick = os.sysconf("SC_CLK_TCK")

    def __call__(self) -> float:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = time.process_time() + kids.ru_utime + kids.ru_stime
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # reaped: counted in RUSAGE_CHILDREN
                continue
            total += (int(stat[11]) + int(stat[12])) / self.tick  # utime, stime
        return total


def machine_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy (every core, every process): /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal (guest is inside user)


def percentiles(lengths: list[int], budget: int) -> dict[str, float]:
    import torch

    qs = (0.1, 0.25, 0.5, 0.75, 0.9)
    q = torch.quantile(torch.tensor(lengths, dtype=torch.float64), torch.tensor(qs, dtype=torch.float64))
    out = {"min": min(lengths), **{f"p{int(p * 100)}": round(float(v), 1) for p, v in zip(qs, q)},
           "max": max(lengths), "mean": round(sum(lengths) / len(lengths), 1)}
    out["at_budget"] = round(sum(n >= budget for n in lengths) / len(lengths), 3)
    return out


def run_way(args) -> dict:
    """One way in this process: the trainer built, `--steps` + 1 steps trained, the timed steps' figures."""
    import torch

    from grpo.configs.rollout import RolloutConfig
    from grpo.configs.sampling import SamplingConfig
    from grpo.configs.training import GRPOConfig
    from grpo.rewards.registry import REWARD_FUNCTIONS
    import grpo.training.loops.grpo_trainer as loop

    asynchronous = args.way == "async"
    torch.set_num_threads(1 if asynchronous else 2)  # async: the trainer's core; the worker takes the other
    torch.ones(2**10).sum()  # the first parallel region on the main thread
    model, tok, prompts = workload(args)
    rollout = (RolloutConfig(mode="async", max_staleness=args.max_staleness, sync_every=1, workers=1, threads=1,
                             reference=args.reference)
               if asynchronous else RolloutConfig(mode="sync"))
    cfg = GRPOConfig(max_steps=args.steps + 1, prompts_per_step=args.prompts_per_step,
                     num_generations=args.num_generations, learning_rate=args.learning_rate, beta=0.04,
                     checkpoint_every=0, samples_every=0, mixed_precision="no", fp32_gemm="mkl",
                     sampling=SamplingConfig(max_new_tokens=args.budget, temperature=1.0, batch_size=64),
                     rewards={"accuracy": 1.0, "digit_share": 1.0}, rollout=rollout)

    lengths: list[list[int]] = []  # each step's completion lengths, from the rollout it trains
    step_metrics = loop.rollout_metrics

    def recorded(rollout, *a, **kw):
        lengths.append(rollout.completion_mask.sum(-1).tolist())
        return step_metrics(rollout, *a, **kw)

    loop.rollout_metrics = recorded  # the loop's own figures, and each step's lengths beside them
    cpu = CpuClock()
    tick = time.perf_counter if args.clock == "wall" else cpu
    # step -> (wall, clock, this way's CPU seconds, the machine's busy seconds) at the end of its metrics callback
    marks: dict[int, tuple[float, float, float, float]] = {}
    seen: dict[int, dict] = {}
    trainer = None

    def on_metrics(step: int, m: dict) -> None:
        if trainer is not None and getattr(trainer.source, "rollouts", None) is not None:
            cpu.pids |= {w.process.pid for w in trainer.source.rollouts.workers if w is not None}
        seen[step] = dict(m)
        marks[step] = (time.perf_counter(), tick(), cpu(), machine_busy_s())

    with tempfile.TemporaryDirectory() as out:
        trainer = loop.GRPOTrainer(model, tok, prompts, cfg, out, progress=False, on_metrics=on_metrics,
                                   reward_functions={**REWARD_FUNCTIONS, "digit_share": digit_share})
        trainer.train()
    timed = range(2, args.steps + 2)  # steps are numbered from 1; the first is the warm-up
    wall = marks[args.steps + 1][0] - marks[1][0]
    seconds = marks[args.steps + 1][1] - marks[1][1]
    own = marks[args.steps + 1][2] - marks[1][2]
    others = max(0.0, marks[args.steps + 1][3] - marks[1][3] - own)  # every other process's CPU seconds
    step_lengths = [n for s in timed for n in lengths[s - 1]]
    tokens = sum(step_lengths)

    def total(name: str) -> float:
        return sum(seen[s][name] for s in timed)

    row = {"way": "async" if asynchronous else "sync", "clock": args.clock, "steps": args.steps,
           "rows_per_step": args.prompts_per_step * args.num_generations, "budget": args.budget}
    if asynchronous:
        row.update(max_staleness=args.max_staleness, threads="trainer 1, worker 1", reference=args.reference)
    else:
        row.update(threads=2)
    row["packed"] = trainer.packed
    row.update(tokens=tokens, seconds=round(seconds, 2), wall_s=round(wall, 2),
               tokens_per_s=round(tokens / seconds, 1), step_s_mean=round(wall / args.steps, 2),
               own_cores=round(own / wall, 2), other_cores=round(others / wall, 2))
    if asynchronous:
        idle = total("async/trainer_idle_s") / wall
        busy = total("async/sampler_busy_s") / wall
        row.update(trainer_busy_share=round(1 - idle, 3), trainer_idle_share=round(idle, 3),
                   sampler_busy_share=round(busy, 3), sampler_idle_share=round(1 - busy, 3),
                   sampler_weight_wait_share=round(total("async/sampler_idle_s") / wall, 3),
                   staleness_mean=round(total("async/staleness_mean") / args.steps, 2),
                   staleness_max=max(seen[s]["async/staleness_max"] for s in timed),
                   buffer_depth_mean=round(total("async/buffer_depth") / args.steps, 2),
                   push_s=round(total("async/push_s"), 3))
    else:
        row.update(sampling_share=round(total("time/generation_s") / wall, 3),
                   training_share=round((total("time/reference_s") + total("time/optimise_s")) / wall, 3))
    row.update(reward_mean=round(total("reward/total") / args.steps, 4),
               lengths=percentiles(step_lengths, args.budget))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps (after one warm-up step)")
    ap.add_argument("--budget", type=int, default=128, help="sampling.max_new_tokens")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4], help="an async run for each max_staleness")
    ap.add_argument("--learning-rate", type=float, default=1e-7)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--eos-scale", type=float, default=10.0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--reference", choices=["trainer", "sampler"], default="trainer",
                    help="async: who scores the reference log-probs (rollout.reference)")
    ap.add_argument("--way", choices=["sync", "async"], help=argparse.SUPPRESS)  # one way, in this process
    ap.add_argument("--max-staleness", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.way:
        print(json.dumps(run_way(args)), flush=True)
        return

    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("steps", "budget", "prompts_per_step", "num_generations", "learning_rate", "prompts",
                       "eos_scale", "clock", "reference")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")

    def one(*way: str) -> dict:
        before = loadavg()
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *way, *passed], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{' '.join(way)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["loadavg"] = f"{before} -> {loadavg()}"  # the 1/5/15-minute load averages as it began and ended
        print(json.dumps(row), flush=True)
        return row

    print(json.dumps(cpu_header()), flush=True)
    sync = one("--way", "sync")
    rows = {k: one("--way", "async", f"--max-staleness={k}") for k in args.staleness}
    print(json.dumps({"tokens_per_s_ratio": {f"async_{k}/sync": round(r["tokens_per_s"] / sync["tokens_per_s"], 2)
                                             for k, r in rows.items()}, "loadavg": loadavg()}), flush=True)


if __name__ == "__main__":
    main()
