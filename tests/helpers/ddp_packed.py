"""Packed GRPO filled to a token budget, run alike in one process or under `accelerate launch`:

    accelerate launch --multi_gpu --num_processes 2 tests/helpers/ddp_packed.py OUT     # what test_packing_ddp.py does

GRPO as tests/helpers/ddp_loops.py runs it (the same prompts, `PromptSeededBackend`'s completions, dapo and a KL
term), with each process's rows packed into micro-batches of at most `BUDGET` tokens. The completions' lengths differ
from prompt to prompt, so the processes fill unequal numbers of packed pieces: `matched_chunks` has the one with fewer
repeat its last at weight 0. Writes OUT/grpo-packed/ as ddp_loops does (metrics from the main process, the final
model), and pieces-rank<R>.json: the packed pieces each step's batch of this process made.
"""

from __future__ import annotations

from grpo import startup  # first: the libraries below load without the cyclic collector

startup.defer_collection()

import json
import sys
from pathlib import Path

from ddp_loops import GRPO, GRPO_PROMPTS, SMALL, PromptSeededBackend, Recorder, digits
from grpo.configs.distributed import DistributedConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.packing import micro_batch_rows

# tokens a packed piece, for rows of 16 to 23 tokens: at the first step (sampled from the starting weights, so the
# same on any CPU) one process packs its 8 rows in 3 pieces, the other in 4
BUDGET = 60
PACKED_GRPO = GRPO.model_copy(update={"memory": GRPO.memory.model_copy(update={"packing": True,
                                                                               "max_tokens_per_microbatch": BUDGET}),
                                      "checkpoint_every": 0, "max_steps": 2})


def run_grpo_packed(out: Path, distributed: DistributedConfig | None = None) -> None:
    folder = out / "grpo-packed"
    model, tok = load_model_and_tokenizer(SMALL)
    trainer = GRPOTrainer(model, tok, GRPO_PROMPTS, PACKED_GRPO, folder, on_metrics=Recorder(folder),
                          reward_functions={"digits": digits}, progress=False, distributed=distributed)
    trainer.engine = PromptSeededBackend(trainer.strategy.sampler_model(), tok)
    pieces, optimise = [], trainer.optimise

    def counted(batch):  # the pieces this process's rows make, before `matched_chunks` evens the count out
        pieces.append(micro_batch_rows(batch.attention_mask, PACKED_GRPO.memory.micro_batch_size, BUDGET))
        return optimise(batch)

    trainer.optimise = counted
    trainer.train()
    (folder / f"pieces-rank{trainer.acc.process_index}.json").write_text(json.dumps(pieces))


if __name__ == "__main__":
    from grpo.training.distributed import exit_process

    startup.imports_done()
    run_grpo_packed(Path(sys.argv[1]), DistributedConfig())
    exit_process()
