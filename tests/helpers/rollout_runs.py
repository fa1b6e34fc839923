"""A short GRPO run on the tiny model with a digits reward: what the asynchronous-rollout tests (sampler processes,
tests/grpo/training/test_rollouts.py; Ray actors, tests/e2e/test_rollout_ray.py) compare against."""

from __future__ import annotations

import pandas as pd
import torch

from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.grpo_trainer import GRPOTrainer
from tiny_configs import SMALL

PROMPTS = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})


def digits(completions, **_):
    """A completion's reward is the digits it holds: a random model writes some, unevenly."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def run(tmp_path, steps=3, seen=None, on_metrics_hook=None, **overrides):
    """A GRPO run of `steps` steps on the tiny model, fp32, MKL GEMMs; its trainer (trained)."""
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(**{"max_steps": steps, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=12, temperature=0.9, top_p=0.9),
                        "rewards": {"digits": 1.0}, "learning_rate": 1e-2, "beta": 0.04, "mixed_precision": "no",
                        "fp32_gemm": "mkl", **overrides})
    seen = {} if seen is None else seen
    trainer = GRPOTrainer(model, tok, PROMPTS, cfg, tmp_path, reward_functions={"digits": digits}, progress=False,
                          on_metrics=on_metrics_hook or (lambda step, m: seen.__setitem__(step, m)))
    trainer.train()
    return trainer


def weights(trainer) -> dict[str, torch.Tensor]:
    """A trainer's policy parameters (name: a copy)."""
    return {n: p.detach().clone() for n, p in trainer.acc.unwrap_model(trainer.model).named_parameters()}
