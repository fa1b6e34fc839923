"""DPO across processes: two CPU processes (gloo, on 127.0.0.1) under ddp and under fsdp give what one process gives
at the same global batch, and only the main one reports. The tolerances are tests/grpo/training/test_distributed.py's
(fp32 rounding of a gradient summed from two halves, a few Adam steps at lr 1e-2)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dpo_loops import STRATEGIES, run_all
from processes import HELPERS, launch_two_processes

KEYS = ["dpo/loss", "dpo/accuracy", "dpo/margin", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/grad_norm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(one process, two processes): each strategy's output folder root."""
    one, two = tmp_path_factory.mktemp("dpo-one"), tmp_path_factory.mktemp("dpo-two")
    launch_two_processes(HELPERS / "dpo_loops.py", two, OMP_NUM_THREADS="1")
    run_all(one)
    return one, two


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dpo_on_two_processes_matches_one(runs, strategy):
    one, two = (root / strategy for root in runs)
    assert sorted(p.name for p in two.glob("metrics-rank*.json")) == ["metrics-rank0.json"]  # only rank 0 reports
    a, b = (json.loads((root / "metrics-rank0.json").read_text()) for root in (one, two))
    assert sorted(a) == sorted(b) == ["1", "2", "3"]
    # at step 1 the policy is its reference: every margin is 0 but for rounding, and a sharded forward rounds unlike
    # the whole reference, so which side of 0 a pair falls on (the accuracy) is noise there
    ties = {("1", "dpo/accuracy")}
    apart = {(step, key): (a[step][key], b[step][key]) for step in a for key in KEYS
             if b[step][key] != pytest.approx(a[step][key], rel=1e-4, abs=1e-6) and (step, key) not in ties}
    assert not apart, f"(step, metric): (one process, two): {apart}"
    assert b["3"]["dpo/heldout_accuracy"] == a["3"]["dpo/heldout_accuracy"]
    ma, mb = (AutoModelForCausalLM.from_pretrained(root / "model") for root in (one, two))
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.allclose(pa, pb, atol=5e-4, rtol=0), (name, (pa - pb).abs().max().item())
