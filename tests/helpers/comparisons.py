"""Comparing runs: what one process reported against what two reported (tests/grpo/training/test_distributed.py
gives the tolerances' reasons), weights against weights, and tensors relative to their size.

The two-process runs are those of ddp_loops.py and ddp_packed.py here, each loop's output under one root folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

RTOL = 1e-4
# figures that cancel to about zero, whose rounding is that of the unit-sized terms they sum: PPO's first-step
# pg_loss is minus the mean of whitened advantages (ratio 1), 0 up to the fp32 rounding of ~100 terms of size ~1
ATOL = {"pg_loss": 1e-6}
PPO_CURVES = ["reward/total", "reward/std", "completion_length", "train/loss", "pg_loss", "value/loss", "kl",
              "grad_norm", "value/grad_norm", "entropy", "value/explained_variance", "advantages/raw_std"]


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    """Equal within fp32 rounding, relative to the values' size."""
    a, b = a.detach(), b.detach()
    return bool((a - b).abs().max() <= rel * max(1.0, float(b.abs().max())))


def reported(root: Path, loop: str) -> dict[int, dict]:
    ranks = sorted(p.name for p in (root / loop).glob("metrics-rank*.json"))
    assert ranks == ["metrics-rank0.json"], f"{loop}: reports came from {ranks}; only rank 0 may report"
    return {int(k): v for k, v in json.loads((root / loop / "metrics-rank0.json").read_text()).items()}


def assert_curves_match(one: dict, two: dict, keys: list[str]) -> None:
    assert sorted(one) == sorted(two)
    apart = {(step, key): (one[step][key], two[step][key]) for step in one for key in keys
             if two[step][key] != pytest.approx(one[step][key], rel=RTOL, abs=ATOL.get(key, 1e-7))}
    assert not apart, f"(step, metric): (one process, two): {apart}"


def assert_same_weights(a: Path, b: Path, atol: float) -> None:
    from transformers import AutoModelForCausalLM

    ma, mb = (AutoModelForCausalLM.from_pretrained(p) for p in (a, b))
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.allclose(pa, pb, atol=atol, rtol=0), (name, (pa - pb).abs().max().item())


def assert_gradients_of_halves(single: dict, two: Path, wrapper: str) -> None:
    """Each of two processes scored half the rows through the chunked head and holds the one-process gradients."""
    from ddp_loops import logps_rows

    ids, _, _ = logps_rows()
    for rank in (0, 1):
        got = torch.load(two / "logps" / f"rank{rank}.pt")
        assert got["wrapper"] == wrapper and got["rows"] == ids.size(0) // 2
        assert got["widest"] == 4 * got["vocab"]  # one 4-token chunk's logits; the plain path makes [rows, C+1, V]
        for name, want in single["grads"].items():  # float32 sums of two halves: rounding only
            torch.testing.assert_close(got["grads"][name], want, rtol=1e-5, atol=1e-6 * want.abs().max().item(),
                                       msg=f"rank {rank}: {name}")


def assert_sft_matches(one: Path, two: Path) -> None:
    from ddp_loops import SFT

    a, b = reported(one, "sft"), reported(two, "sft")
    assert sorted(a) == list(range(1, SFT.max_steps + 1))
    assert_curves_match(a, b, ["train/loss", "train/grad_norm", "train/learning_rate"])
    assert a[1]["train/loss"] > a[3]["train/loss"]  # it trained
    assert_same_weights(one / "sft" / "model", two / "sft" / "model", atol=2e-5)


def assert_ppo_matches(one: Path, two: Path, loop: str = "ppo") -> None:
    """PPO on two processes, each sampling half the prompts: the global batch's figures (the whitening of the
    advantages, the KL, the critic's fit), the policy and the critic are one process's."""
    a, b = reported(one, loop), reported(two, loop)
    assert_curves_match(a, b, PPO_CURVES)
    assert a[sorted(a)[0]]["reward/std"] > 0 and a[sorted(a)[-1]]["kl"] > 0  # rewards differed; the policy moved
    assert_same_weights(one / loop / "model", two / loop / "model", atol=5e-4)
    critic = torch.load(one / loop / "critic-rank0.pt")
    for rank in (0, 1):  # the critic trained alike (gathered whole on each process)
        got = torch.load(two / loop / f"critic-rank{rank}.pt")
        for name, want in critic.items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=5e-4, msg=f"rank {rank}: critic {name}")
