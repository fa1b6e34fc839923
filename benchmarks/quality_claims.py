"""What the tiny reward model and process reward model learn: held-out figures over seeds, not pass/fail tests.

The suite checks that each trains (its loss falls, its saved folder reloads to the model evaluated, its scores keep
the reward contract); how well they learn is a figure of the model, budget and task, measured here:

- reward model (`grpo.training.loops.reward_model`), 60 steps on 1,000 synthetic preference pairs: held-out pair
  accuracy before and after, and by flaw;
- process reward model (`grpo.training.loops.prm`), 150 steps on 300 labelled worked solutions: held-out step AUC
  before and after.

    .venv/bin/python benchmarks/quality_claims.py --seeds 0 1 2

fp32, one thread, so the figures depend on the seed only (not on the CPU's bf16 or its load).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from grpo.configs.data import TaskConfig
from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.configs.reward import RewardModelConfig
from grpo.data.arithmetic import generate_problems
from grpo.data.preferences import preference_pairs
from grpo.training.loops.prm import build_prm, evaluate_prm, label_worked_solutions, train_prm
from grpo.training.loops.reward_model import train_reward_model

SMALL = ModelConfig(tiny=TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))


def reward_model(seed: int, folder: Path) -> dict:
    torch.manual_seed(seed)
    cfg = RewardModelConfig(model=SMALL, max_steps=60, batch_size=16, learning_rate=3e-3, warmup_steps=5,
                            mixed_precision="no", seed=seed)
    result = train_reward_model(preference_pairs(1000), cfg, folder, lambda s, m: None,
                                heldout=preference_pairs(200, split="heldout"), progress=False)
    flaws = {k.rsplit("/", 1)[1]: round(v, 3) for k, v in result.heldout_metrics.items()
             if k.startswith("rm/heldout_accuracy/")}
    return {"heldout_accuracy_before": round(result.heldout_accuracy_before, 3),
            "heldout_accuracy": round(result.heldout_accuracy, 3), "by_flaw": flaws, "seconds": round(result.seconds, 1)}


def process_reward_model(seed: int, folder: Path) -> dict:
    torch.manual_seed(seed)
    task = TaskConfig(max_operand=5)
    train = label_worked_solutions(generate_problems(task, 300, "train"), seed=seed)
    heldout = label_worked_solutions(generate_problems(task, 100, "heldout"), seed=seed + 1)
    cfg = RewardModelConfig(model=SMALL, max_steps=150, batch_size=32, learning_rate=3e-3, warmup_steps=10,
                            mixed_precision="no", log_every=50, seed=seed)
    untrained, tok = build_prm(SMALL)
    before = evaluate_prm(untrained, tok, heldout)["prm/heldout_auc"]
    result = train_prm(train, cfg, folder, heldout=heldout)
    return {"heldout_auc_before": round(before, 3), "heldout_auc": round(result.heldout["prm/heldout_auc"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps({"seed": seed, "reward_model": reward_model(seed, Path(d) / "rm"),
                              "prm": process_reward_model(seed, Path(d) / "prm")}), flush=True)


if __name__ == "__main__":
    main()
