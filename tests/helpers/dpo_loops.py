"""The DPO loop on a tiny model, run alike in one process or under `accelerate launch`
(tests/grpo/training/loops/test_dpo_distributed.py):

    accelerate launch --multi_gpu --num_processes 2 tests/helpers/dpo_loops.py OUT

runs it under each strategy (ddp, then fsdp) into OUT/<strategy>: the metrics its processes reported go to
OUT/<strategy>/metrics-rank<R>.json (a file from a rank other than 0 means that rank reported) and the final model to
OUT/<strategy>/model. A checkpoint is written at step 2 of 3, so saving goes through each strategy too.
"""

from __future__ import annotations

from grpo import startup  # first: the libraries below load without the cyclic collector

startup.defer_collection()

import json
import os
import sys
from pathlib import Path

import torch

from grpo.configs.distributed import DistributedConfig
from grpo.configs.dpo import DPOConfig
from grpo.data.preferences import preference_pairs
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.dpo import train_dpo
from tiny_configs import SMALL

DPO = DPOConfig(max_steps=3, batch_size=4, learning_rate=1e-2, warmup_steps=0, mixed_precision="no",
                checkpoint_every=2, log_every=1)
STRATEGIES = ("ddp", "fsdp")


def run_dpo(out: Path, strategy: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, tokenizer = load_model_and_tokenizer(SMALL)
    seen: dict[int, dict[str, float]] = {}
    train_dpo(model, tokenizer, preference_pairs(16), DPO, out, lambda s, m: seen.setdefault(s, {}).update(m),
              heldout=preference_pairs(6, split="heldout"), progress=False,
              distributed=DistributedConfig(strategy=strategy))
    if seen:
        (out / f"metrics-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))


def run_all(out: Path) -> None:
    for strategy in STRATEGIES:
        run_dpo(out / strategy, strategy)


if __name__ == "__main__":
    from grpo.training.distributed import exit_process

    startup.imports_done()
    run_all(Path(sys.argv[1]))
    exit_process()
