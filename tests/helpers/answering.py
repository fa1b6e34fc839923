"""A tiny model taught to answer `<answer>1</answer>`: the rejection-sampling tests sample from it (tests/conftest.py's
`answering_checkpoint`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from grpo.configs.model import ModelConfig
from grpo.configs.training import SFTConfig
from tiny_configs import TINY_MODEL as SMALL


def train_answering_checkpoint(out: Path) -> str:
    """Trained in a few seconds; it gets the prompts whose answer is 1 right most of the time when sampled, so the
    rule check keeps some samples and drops others. Returns the checkpoint folder."""
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft

    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    rows = pd.DataFrame({"prompt": [f"Question {i}?" for i in range(32)],
                         "response": ["<think>It is one.</think><answer>1</answer>"] * 32})
    train_sft(model, tok, rows, SFTConfig(max_steps=150, batch_size=16, learning_rate=5e-3, warmup_steps=2,
                                          mixed_precision="no", checkpoint_every=0), out, progress=False)
    return str(out / "model")
