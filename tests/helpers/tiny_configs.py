"""The tiny model the tests train (hidden 64, intermediate 128, 2 layers, 2 heads, 1 key-value head), and the
cut-down recipe sections built on it that many test files share.

`TINY` is the model as a recipe writes it (`model: {tiny: ...}`), `TINY_MODEL` and `SMALL` the same as configs. It is
the model conftest's `logged_checkpoint` and `answering_checkpoint` hold, so a stage given either starts from it.
"""

from __future__ import annotations

from grpo.configs.model import ModelConfig, TinyModelConfig

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1}
LOGGED_TINY = TINY  # the model conftest's `logged_checkpoint` holds
TINY_MODEL = TinyModelConfig(**TINY)
SMALL = ModelConfig(tiny=TINY_MODEL)

TINY_STAGE = {
    "model": {"tiny": TINY},
    "data": {"num_train": 64, "num_heldout": 8},
    # fp32 wherever these sections are used: the tests that are about `auto` say so and are marked `precision`
    "train": {"max_steps": 4, "batch_size": 8, "log_every": 2, "checkpoint_every": 0, "mixed_precision": "no"},
    "eval": {"num_prompts": 8, "num_samples": 2, "max_new_tokens": 24, "num_logged_samples": 4},
}


TINY_GRPO = {
    "model": TINY_STAGE["model"],
    "data": {"num_train": 32, "num_heldout": 8},
    "grpo": {"max_steps": 2, "prompts_per_step": 2, "num_generations": 4, "sampling": {"max_new_tokens": 16},
             "samples_every": 1, "checkpoint_every": 0, "mixed_precision": "no"},
    "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16, "num_logged_samples": 4},
}


TINY_RS = {
    "model": TINY_STAGE["model"],
    "data": {"num_train": 16, "num_heldout": 8},
    "rejection": {"samples_per_prompt": 2, "sampling": {"max_new_tokens": 24}, "target_samples": 24,
                  "non_reasoning_rows": 6, "shard_size": 8},
}

TINY_SFT = {k: TINY_STAGE[k] for k in ("model", "train", "eval")}

TINY_ALIGN = {
    "model": TINY_STAGE["model"],
    "data": {"num_train": 16, "num_heldout": 8},
    "general_prompts": 8,
    "preferences": {"num_train": 32, "num_heldout": 16},
    "reward_model": {"model": TINY_STAGE["model"], "max_steps": 3, "batch_size": 8, "mixed_precision": "no"},
    "grpo": {**TINY_GRPO["grpo"], "rewards": {"accuracy": 1.0, "format": 0.5, "reward_model": 1.0}},
    "eval": TINY_GRPO["eval"],
    "registered_model": "r1-test",
}

ALL_STAGES = {"name": "test", "cold_start_sft": TINY_STAGE, "reasoning_grpo": TINY_GRPO, "rejection_sampling": TINY_RS,
              "sft": TINY_SFT, "alignment_grpo": TINY_ALIGN}

# a cold start whose loop is launched on two processes (tests/grpo/training/test_distributed.py, the signal tests)
DISTRIBUTED_STAGE = {
    "model": {"tiny": TINY},
    "data": {"num_train": 64, "num_heldout": 8},
    "train": {"max_steps": 4, "batch_size": 8, "log_every": 2, "checkpoint_every": 0, "mixed_precision": "no"},
    "eval": {"num_prompts": 8, "num_samples": 0, "max_new_tokens": 16, "num_logged_samples": 2},
    "distributed": {"num_processes": 2},
}
