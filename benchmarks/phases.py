"""Where a GRPO step goes, for the project and for TRL, on the shared bench's workload: the phase split.

usage: python benchmarks/phases.py MODEL_DIR [--workload PATH] [--side ours trl]
MODEL_DIR comes from benchmarks/peers/make_tiny_model.py. Each side runs in a process of its own (as compare.py
runs them): the project's `benchmarks/grpo_step.py`, or the shared bench's `trl_grpo_peer.py` (trl==1.16.0, in the
dev extra), with timers put around the same phases on both sides:

- sampling: the prompts' completions generated (TRL's `GRPOTrainer._generate`, the project's local engine's
  `generate`);
- reference: the log-prob passes made without gradients (the frozen reference's, and pi_old's where kept: TRL's
  `_get_per_token_logps_and_entropies` while grad is off, the project's `PolicyRuntime.scored`);
- backward: `torch.autograd.backward` (with recomputation where a side checkpoints activations);
- optimizer: the optimizer's `step` (from torch's global step hooks);
- forward and the rest: the step's wall time less those (the policy's forward and loss, rewards, bookkeeping).

A step is the time between two optimizer steps (each side takes one a step on this workload); the first
`warmup_steps_excluded_from_timing` are left out and each figure is the median over the rest. Prints one JSON line
per side. The timers add a few function calls a step, the same on both sides.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "shared" / "bench"
PHASES = ("sampling", "reference", "backward", "optimizer")


class Timers:
    """Seconds spent in each phase, snapshotted at the end of each optimizer step."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.marks: list[tuple[float, dict[str, float]]] = []
        self._open: dict[str, float] = {}

    def wrap(self, owner, name: str, phase: str, when=lambda *a, **k: True) -> None:
        """Time `owner.name` as `phase` (calls for which `when(*args)` holds; nested calls count once)."""
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if phase in self._open or not when(*args, **kwargs):
                return fn(*args, **kwargs)
            self._open[phase] = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - self._open.pop(phase)

        setattr(owner, name, timed)

    def install_common(self) -> None:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.wrap(torch.autograd, "backward", "backward")
        register_optimizer_step_pre_hook(lambda *_: self._open.__setitem__("optimizer", time.perf_counter()))

        def after_step(*_):
            self.totals["optimizer"] += time.perf_counter() - self._open.pop("optimizer")
            self.marks.append((time.perf_counter(), dict(self.totals)))

        register_optimizer_step_post_hook(after_step)

    def figures(self, skip: int) -> dict[str, float]:
        steps = [(t1 - t0, {p: b.get(p, 0.0) - a.get(p, 0.0) for p in PHASES})
                 for (t0, a), (t1, b) in zip(self.marks, self.marks[1:])][max(skip - 1, 0):]
        out = {"steps_timed": len(steps), "step_s": round(statistics.median(s for s, _ in steps), 4)}
        for p in PHASES:
            out[f"{p}_s"] = round(statistics.median(d[p] for _, d in steps), 4)
        out["forward_and_rest_s"] = round(statistics.median(s - sum(d.values()) for s, d in steps), 4)
        return out


def run_side(side: str, model_dir: str, workload: str) -> None:
    """In this process: the side's own benchmark script under the timers, then one JSON line of its phases."""
    import torch

    timers = Timers()
    timers.install_common()
    no_grad = lambda *a, **k: not torch.is_grad_enabled()  # noqa: E731
    if side == "trl":
        from trl import GRPOTrainer

        timers.wrap(GRPOTrainer, "_generate", "sampling")
        timers.wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", "reference", no_grad)
        sys.argv = ["trl_grpo_peer.py", model_dir, "--workload", workload]
        runpy.run_path(str(BENCH / "trl_grpo_peer.py"), run_name="__main__")
    else:
        from grpo.sampling.local.backend import TransformersBackend
        from grpo.training.runtime import PolicyRuntime

        timers.wrap(TransformersBackend, "generate", "sampling")
        timers.wrap(PolicyRuntime, "scored", "reference")  # it turns gradients off itself
        sys.argv = ["grpo_step.py", "--workload", workload, model_dir]
        try:
            runpy.run_path(str(HERE / "grpo_step.py"), run_name="__main__")
        except SystemExit as e:  # its `sys.exit(main())`
            if e.code:
                raise
    skip = json.loads(Path(workload).read_text())["grpo"]["warmup_steps_excluded_from_timing"]
    print(json.dumps({"side": side, "threads": torch.get_num_threads(), **timers.figures(skip)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--workload", default=str(BENCH / "workload.json"))
    ap.add_argument("--side", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    ap.add_argument("--one", choices=["ours", "trl"], help=argparse.SUPPRESS)  # the child process's side
    args = ap.parse_args()
    if args.one:
        return run_side(args.one, args.model_dir, args.workload)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for side in args.side:
        out = subprocess.run([sys.executable, __file__, args.model_dir, "--workload", args.workload, "--one", side],
                             capture_output=True, text=True, env=env)
        lines = [line for line in out.stdout.splitlines() if line.startswith('{"side"')]
        if out.returncode != 0 or not lines:
            sys.exit(f"{side} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
