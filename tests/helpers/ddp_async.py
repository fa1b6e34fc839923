"""GRPO on two processes under `accelerate launch`, synchronous and then asynchronous at max_staleness 0.

    R1_TEST_STRATEGY=ddp|fsdp accelerate launch --multi_gpu --num_processes 2 tests/helpers/ddp_async.py OUT

Each run writes its final model to OUT/<sync|async>/model and its main process's metrics to
OUT/<sync|async>/metrics-rank0.json. One thread a process and one a worker, fp32, MKL GEMMs: the two runs sample the
same tokens from the same weights, so their final weights compare bit for bit
(tests/grpo/training/test_rollouts.py).
"""

from __future__ import annotations

from grpo import startup  # first: the libraries below load without the cyclic collector

startup.defer_collection()

import os
import sys
from pathlib import Path

import torch

from ddp_loops import GRPO, GRPO_PROMPTS, SMALL, Recorder, digits
from grpo.configs.distributed import DistributedConfig
from grpo.configs.rollout import RolloutConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.grpo_trainer import GRPOTrainer


def run(out: Path, strategy: str, rollout: RolloutConfig) -> None:
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(SMALL)
    # the synchronous run takes the asynchronous one's behaviour-weight cap as its TIS cap: the same loss
    cfg = GRPO.model_copy(update={"rollout": rollout, "loss": GRPO.loss.model_copy(update={"tis_cap": 2.0}),
                                  "checkpoint_every": 0, "samples_every": 0})
    GRPOTrainer(model, tok, GRPO_PROMPTS, cfg, out, on_metrics=Recorder(out), reward_functions={"digits": digits},
                progress=False, distributed=DistributedConfig(strategy=strategy)).train()


if __name__ == "__main__":
    from grpo.training.distributed import exit_process

    startup.imports_done()
    torch.set_num_threads(1)
    root, strategy = Path(sys.argv[1]), os.environ["R1_TEST_STRATEGY"]
    run(root / "sync", strategy, RolloutConfig())
    run(root / "async", strategy, RolloutConfig(mode="async", max_staleness=0, threads=1))
    exit_process()
