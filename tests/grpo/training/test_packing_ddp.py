"""Packed GRPO filled to a token budget on two CPU processes (gloo, on 127.0.0.1) gives what one process gives.

tests/helpers/ddp_packed.py runs it in two launched processes whose rows make unequal numbers of packed pieces, then
here in one. Both see the same completions from the same weights, so they differ only in float32 rounding; the bounds
are tests/grpo/training/test_distributed.py's, which says why.
"""

from __future__ import annotations

import json

import torch

from comparisons import assert_curves_match, assert_same_weights, reported
from ddp_packed import BUDGET, PACKED_GRPO, run_grpo_packed
from processes import HELPERS, launch_two_processes


def test_packed_grpo_with_unequal_pieces_on_two_processes_matches_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    launch_two_processes(HELPERS / "ddp_packed.py", two)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_grpo_packed(one)
    finally:
        torch.set_num_threads(threads)
    pieces = [json.loads((two / "grpo-packed" / f"pieces-rank{r}.json").read_text()) for r in (0, 1)]
    # each process packed its own 8 rows; at the first step one made more pieces than the other
    assert all(sorted(i for p in step for i in p) == list(range(8)) for rank in pieces for step in rank)
    assert len(pieces[0][0]) != len(pieces[1][0]), pieces
    assert max(len(p) for rank in pieces for step in rank for p in step) >= 2  # pieces of several rows: packed
    a, b = reported(one, "grpo-packed"), reported(two, "grpo-packed")
    assert sorted(a) == list(range(1, PACKED_GRPO.max_steps + 1))
    assert_curves_match(a, b, ["reward/total", "reward/std", "completion_length", "train/loss", "kl", "grad_norm",
                               "entropy"])
    assert a[1]["reward/std"] > 0  # groups had spread: the steps carried a gradient
    assert_same_weights(one / "grpo-packed" / "model", two / "grpo-packed" / "model", atol=5e-4)
    assert BUDGET == PACKED_GRPO.memory.max_tokens_per_microbatch
