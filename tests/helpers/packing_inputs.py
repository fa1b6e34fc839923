"""Tiny real Qwen2 and Qwen3 decoders built from a config (float32, perturbed so biases and norms matter) and rows
shaped as GRPO makes them: what the packing tests (tests/grpo/training/test_packing.py, loops/test_packing_loops.py)
run packed and padded."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

V, PAD = 64, 0


def make_model(kind: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if kind == "qwen2" else Qwen3ForCausalLM(
        Qwen3Config(**common, head_dim=8))
    with torch.no_grad():
        for p in model.parameters():  # biases and norm weights start at 0 and 1: make them matter
            p.add_(torch.randn_like(p) * 0.05)
        model.lm_head.weight.mul_(10.0)  # peakier distributions than a random init's near-uniform
    return model.float()


def grpo_rows(prompt_lens: list[int], completion_lens: list[int], group: int, seed: int = 1):
    """Rows as GRPO makes them: `group` rows a prompt (the same tokens), left-padded prompts, right-padded
    completions. prompt_lens: one a group; completion_lens: one a row."""
    g = torch.Generator().manual_seed(seed)
    N, P, C = len(completion_lens), max(prompt_lens), max(max(completion_lens), 1)
    ids = torch.full((N, P + C), PAD)
    mask = torch.zeros(N, P + C, dtype=torch.long)
    for r, c in enumerate(completion_lens):
        p = prompt_lens[r // group]
        if r % group == 0:
            prompt = torch.randint(1, V, (p,), generator=g)
        ids[r, P - p:P], mask[r, P - p:P] = prompt, 1
        ids[r, P:P + c], mask[r, P:P + c] = torch.randint(1, V, (c,), generator=g), 1
    return ids, mask, C
