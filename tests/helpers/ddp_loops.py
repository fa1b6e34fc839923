"""The SFT, GRPO, PPO and reward-model loops on a tiny model, run alike in one process or under `accelerate launch`.

    accelerate launch --multi_gpu --num_processes 2 tests/helpers/ddp_loops.py OUT     # what test_distributed.py does
    accelerate launch --multi_gpu --num_processes 2 tests/helpers/ddp_loops.py OUT fsdp [RESUME]   # test_fsdp.py

Each loop writes the metrics its main process reported to OUT/<loop>/metrics-rank<R>.json (so a file from any
other rank means a rank other than 0 reported) and its final model to OUT/<loop>/model. GRPO samples through
`PromptSeededBackend`: each prompt's completions come from a generator seeded by the prompt and the step, so one
process and two draw the same completions while their weights agree, and their curves compare; each prompt gets a
completion budget of its own, so the processes hold unequal numbers of tokens (what DAPO's token mean must see).
PPO samples the same way, one completion a prompt. The second argument names the strategy (ddp by default); SFT's,
GRPO's and PPO's step-2 checkpoints are kept in OUT/<loop>-step-2, and SFT (and under fsdp GRPO and PPO) is run again
from RESUME's (another run's OUT) or from its own.
"""

from __future__ import annotations

from grpo import startup  # first: the libraries below load without the cyclic collector

startup.defer_collection()

import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo.configs.distributed import DistributedConfig
from grpo.configs.lora import LoRAConfig
from grpo.configs.ppo import PPOConfig
from grpo.configs.reward import RewardModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig, SFTConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.local.backend import Rollout, TransformersBackend
from grpo.training.accelerator import make_accelerator
from grpo.training.distributed import process_share
from grpo.training.logprobs import token_logps
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loops.ppo_trainer import PPOTrainer
from grpo.training.loops.reward_model import train_reward_model
from grpo.training.loops.sft_trainer import train_sft
from grpo.training.strategy import make_strategy
from tiny_configs import SMALL

SFT_ROWS = pd.DataFrame({"prompt": [f"What is {i} + {i % 3}?" for i in range(16)],
                         "response": [f"<think>{i} + {i % 3} = {i + i % 3}.</think><answer>{i + i % 3}</answer>"
                                      * (1 + 3 * (i % 2)) for i in range(16)]})  # uneven lengths: token means matter
# global micro-batch 8 rows (4 per process), 2 micro-batches a step; a checkpoint at step 2 of 3. The fp32 GEMMs
# pinned to MKL: `auto` times MKL against oneDNN in each run, and where they are about even (an AVX2 EPYC) a run of one
# process and a run of two could take different libraries, which round apart (then AdamW's step of a near-zero
# gradient does not match to 2e-5 of the weights)
SFT = SFTConfig(max_steps=3, batch_size=8, grad_accum_steps=2, learning_rate=3e-3, warmup_steps=0, log_every=1,
                checkpoint_every=2, mixed_precision="no", seed=3, fp32_gemm="mkl")
GRPO_PROMPTS = pd.DataFrame({"prompt": [f"Count to {i}" for i in range(8)]})
# 4 prompts x 4 completions a step (2 prompts per process), micro-batches of 4 rows; dapo's token mean and a KL term
GRPO = GRPOConfig(max_steps=3, prompts_per_step=4, num_generations=4, micro_batch_size=4, learning_rate=1e-2,
                  warmup_steps=0, beta=0.04, loss_type="dapo", rewards={"digits": 1.0}, checkpoint_every=2,
                  log_every=1, samples_every=1, mixed_precision="no", fp32_gemm="mkl",
                  sampling=SamplingConfig(max_new_tokens=10, temperature=1.0))
# PPO: one completion for each of 2 x 4 = 8 prompts a step (4 per process), micro-batches of 2 rows; the KL in the
# rewards (k1, so pi_old's log-probs are computed) and dapo's token mean over both models' losses
PPO = GRPO.model_copy(update={"prompts_per_step": 2, "memory": GRPO.memory.model_copy(update={"micro_batch_size": 2}),
                              "optimizer": GRPO.optimizer.model_copy(update={"learning_rate": 3e-3})})
PPO_SETTINGS = PPOConfig(vf_coef=0.5)
PAIRS = pd.DataFrame({"prompt": [f"Q{i}" for i in range(16)], "chosen": [f"A good answer {i}." for i in range(16)],
                      "rejected": [f"bad {i}" * (1 + i % 3) for i in range(16)]})
RM = RewardModelConfig(model=SMALL, max_steps=3, batch_size=4, learning_rate=1e-3, warmup_steps=0, log_every=1,
                       eval_fraction=0.0, mixed_precision="no")


def digits(completions, **_):
    """A completion's reward is how many digits it holds: a random model writes some, unevenly."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


class PromptSeededBackend:
    """Transformers sampling, one prompt at a time from a generator seeded by the prompt and the step (the trainer
    calls it once a step)."""

    def __init__(self, model, tokenizer):
        self.inner, self.steps, self.pad_id = TransformersBackend(model, tokenizer), 0, tokenizer.pad_token_id

    def sync_weights(self) -> None:
        self.inner.sync_weights()

    def generate(self, prompts: list, n: int, sampling: SamplingConfig, logprobs: bool = False) -> Rollout:
        parts = []
        self.steps += 1
        for prompt in prompts:
            seed = zlib.crc32(prompt.encode()) * 100 + self.steps
            torch.manual_seed(seed)
            # a budget per prompt (a random model rarely stops by itself): processes hold unequal token counts
            budget = sampling.model_copy(update={"max_new_tokens": 3 + seed % 9})
            parts.append(self.inner.generate([prompt], n, budget, logprobs=logprobs))
        P = max(r.prompt_ids.size(1) for r in parts)
        C = max(r.completion_ids.size(1) for r in parts)

        def pad(t, width, value, left=False):
            extra = width - t.size(1)
            return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

        return Rollout(prompt_ids=torch.cat([pad(r.prompt_ids, P, self.pad_id, left=True) for r in parts]),
                       prompt_mask=torch.cat([pad(r.prompt_mask, P, 0, left=True) for r in parts]),
                       completion_ids=torch.cat([pad(r.completion_ids, C, self.pad_id) for r in parts]),
                       completion_mask=torch.cat([pad(r.completion_mask, C, 0) for r in parts]),
                       logprobs=torch.cat([pad(r.logprobs, C, 0.0) for r in parts]) if logprobs else None,
                       truncated=torch.cat([r.truncated for r in parts]),
                       texts=[t for r in parts for t in r.texts])


class Recorder:
    """A loop's metrics callback: what it was told, written to a file named by the rank that told it."""

    def __init__(self, folder: Path):
        self.folder, self.seen = folder, {}
        folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        checkpoint = self.folder / "checkpoints" / "step-2"
        if step == 3 and checkpoint.exists():  # the run's checkpoint, complete, before the finished run clears it
            metrics = {**metrics, "checkpoint_files": sorted(p.name for p in checkpoint.iterdir())}
            if self.folder.name in ("sft", "grpo", "ppo"):  # what an interrupted run would have left: `run_*_resumed`
                shutil.copytree(checkpoint, self.folder.with_name(f"{self.folder.name}-step-2"))
        self.seen[step] = metrics
        rank = os.environ.get("RANK", "0")
        (self.folder / f"metrics-rank{rank}.json").write_text(json.dumps(self.seen))


def run_sft(out: Path, distributed: DistributedConfig | None = None) -> None:
    model, tok = load_model_and_tokenizer(SMALL)
    train_sft(model, tok, SFT_ROWS, SFT, out / "sft", Recorder(out / "sft"), progress=False, distributed=distributed)


def place_checkpoint(source: Path, out: Path) -> None:
    """Copy a step-2 checkpoint into `out`'s checkpoint folder, where a loop writing to `out` resumes from it."""
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.copytree(source, out / "checkpoints" / "step-2")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # every process finds the whole folder


def run_sft_resumed(out: Path, distributed: DistributedConfig | None = None, source: Path | None = None) -> None:
    """SFT again from a step-2 checkpoint (`source`, or the one the first run left): it trains step 3 only."""
    place_checkpoint(source or out / "sft-step-2", out / "sft-resumed")
    model, tok = load_model_and_tokenizer(SMALL)
    train_sft(model, tok, SFT_ROWS, SFT, out / "sft-resumed", Recorder(out / "sft-resumed"), progress=False,
              distributed=distributed)


def run_grpo(out: Path, distributed: DistributedConfig | None = None) -> None:
    model, tok = load_model_and_tokenizer(SMALL)
    recorder = Recorder(out / "grpo")
    trainer = GRPOTrainer(model, tok, GRPO_PROMPTS, GRPO, out / "grpo", on_metrics=recorder,
                          engine=None, reward_functions={"digits": digits}, progress=False,
                          on_samples=lambda step, table: table.to_json(out / "grpo" / f"samples-{step}.json"),
                          distributed=distributed)
    trainer.engine = PromptSeededBackend(trainer.strategy.sampler_model(), tok)
    syncs = watch_sampler_syncs(trainer)
    trainer.train()
    (out / "grpo" / f"syncs-rank{trainer.acc.process_index}.json").write_text(json.dumps(syncs))


def run_grpo_resumed(out: Path, distributed: DistributedConfig | None = None, source: Path | None = None) -> None:
    """GRPO again from a step-2 checkpoint (`source`, or the one the first run left): it trains step 3 only, on
    the completions the whole run sampled at step 3."""
    place_checkpoint(source or out / "grpo-step-2", out / "grpo-resumed")
    model, tok = load_model_and_tokenizer(SMALL)
    trainer = GRPOTrainer(model, tok, GRPO_PROMPTS, GRPO, out / "grpo-resumed", on_metrics=Recorder(out / "grpo-resumed"),
                          reward_functions={"digits": digits}, progress=False, distributed=distributed)
    trainer.engine = PromptSeededBackend(trainer.strategy.sampler_model(), tok)
    trainer.engine.steps = 2  # the draws of step 3 follow
    trainer.train()


def run_ppo(out: Path, distributed: DistributedConfig | None = None, source: Path | None = None) -> None:
    """PPO: the policy and its critic held alike by the strategy. With `source` (a step-2 checkpoint) it resumes
    from it into OUT/ppo-resumed and trains step 3 only, on the completions the whole run sampled at step 3."""
    folder = out / ("ppo-resumed" if source else "ppo")
    if source:
        place_checkpoint(source, folder)
    model, tok = load_model_and_tokenizer(SMALL)
    trainer = PPOTrainer(model, tok, GRPO_PROMPTS, PPO, folder, ppo=PPO_SETTINGS, on_metrics=Recorder(folder),
                         reward_functions={"digits": digits}, progress=False, distributed=distributed)
    trainer.engine = PromptSeededBackend(trainer.strategy.sampler_model(), tok)
    trainer.engine.steps = 2 if source else 0
    syncs = watch_sampler_syncs(trainer)
    trainer.train()
    critic = trainer.acc.unwrap_model(trainer.critic)  # the critic's whole weights, gathered on every process
    torch.save({n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in critic.named_parameters()}, folder / f"critic-rank{trainer.acc.process_index}.pt")
    if not source:
        (folder / f"syncs-rank{trainer.acc.process_index}.json").write_text(json.dumps(syncs))


def run_grpo_lora(out: Path, distributed: DistributedConfig | None = None) -> None:
    """GRPO with LoRA adapters (the reference is the policy with them off) and activation checkpointing."""
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPO.model_copy(update={"lora": LoRAConfig(r=4, alpha=8.0),
                                  "memory": GRPO.memory.model_copy(update={"gradient_checkpointing": True}),
                                  "optimizer": GRPO.optimizer.model_copy(update={"learning_rate": 3e-3})})
    trainer = GRPOTrainer(model, tok, GRPO_PROMPTS, cfg, out / "grpo-lora", on_metrics=Recorder(out / "grpo-lora"),
                          reward_functions={"digits": digits}, progress=False, distributed=distributed)
    trainer.engine = PromptSeededBackend(trainer.strategy.sampler_model(), tok)
    syncs = watch_sampler_syncs(trainer)
    trainer.train()
    (out / "grpo-lora" / f"syncs-rank{trainer.acc.process_index}.json").write_text(json.dumps(syncs))


def watch_sampler_syncs(trainer: GRPOTrainer) -> list[float]:
    """After each of the trainer's weight syncs: the largest difference between the sampler's copy and the
    policy's whole weights (every process gathers them: a collective at the same points on each)."""
    seen, sync = [], trainer.sync_sampler

    def checked() -> None:
        sync()
        copy = dict(trainer.strategy.sampler_model().named_parameters())
        gap = 0.0
        for name, p in trainer.acc.unwrap_model(trainer.model).named_parameters():
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            gap = max(gap, (copy[name].detach() - whole.detach()).abs().max().item())
        seen.append(gap)

    trainer.sync_sampler = checked
    return seen


def run_reward_model(out: Path, distributed: DistributedConfig | None = None) -> None:
    train_reward_model(PAIRS, RM, out / "rm", Recorder(out / "rm"), progress=False, distributed=distributed)


def logps_rows(groups: int = 4, G: int = 2, P: int = 5, C: int = 6, vocab: int = 1000):
    """Rows in groups of G sharing a left-padded prompt, then right-padded completions: (ids, mask, C)."""
    gen = torch.Generator().manual_seed(5)
    pmask = (torch.arange(P) >= P - torch.tensor([2, 5, 3, 4][:groups])[:, None]).long()  # [groups, P]
    prompt = (torch.randint(1, vocab, (groups, P), generator=gen) * pmask).repeat_interleave(G, 0)
    comp = torch.randint(1, vocab, (groups * G, C), generator=gen)
    cmask = (torch.arange(C) < torch.randint(2, C + 1, (groups * G, 1), generator=gen)).long()  # [N, C]
    return torch.cat([prompt, comp * cmask], 1), torch.cat([pmask.repeat_interleave(G, 0), cmask], 1), C


class WidestVocabularyTensor(TorchDispatchMode):
    """Within the block: the most elements of any tensor an op makes whose last axis is the vocabulary (but for the
    head's weight seen as [H, V])."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.weight_t, self.most = vocab, (hidden, vocab), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.size(-1) == self.vocab and t.shape != self.weight_t:
                self.most = max(self.most, t.numel())
        return out


def run_logps(out: Path, distributed: DistributedConfig | None = None) -> None:
    """The chunked head's log-probs (plain_max_bytes=0, 4-token chunks) on the prepared model, backward once: each
    process scores its share of the rows and DDP averages the gradients. Writes this process's gradients, the
    largest vocabulary-wide tensor made in the forward and backward (the full logits: [rows, C, V]) and the
    model's type."""
    acc = make_accelerator("no")
    model, tok = load_model_and_tokenizer(SMALL)
    model = make_strategy(acc, distributed).prepare(model.train())
    ids, mask, C = logps_rows()
    mine = process_share(acc, list(range(ids.size(0))))  # whole groups: 4 of the 8 rows in each of 2 processes
    with WidestVocabularyTensor(len(tok), SMALL.tiny.hidden_size) as widest:
        logps, _ = token_logps(model, ids[mine], mask[mine], C, 0.7, with_entropy=True, plain_max_bytes=0,
                               chunk_tokens=4)  # [n, C]
        weights = mask[mine, -C:].float() * torch.linspace(-1, 1, C)  # [n, C]
        acc.backward((logps * weights).sum() / len(mine))  # DDP's mean over processes: the mean over all rows
    folder = out / "logps"
    folder.mkdir(parents=True, exist_ok=True)
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for n, p in acc.unwrap_model(model).named_parameters()}  # whole gradients (gathered under fsdp)
    torch.save({"grads": grads,
                "widest": widest.most, "vocab": len(tok), "rows": len(mine), "wrapper": type(model).__name__},
               folder / f"rank{acc.process_index}.pt")


def run_all(out: Path, strategy: str = "ddp", resume: Path | None = None) -> None:
    distributed = DistributedConfig(strategy=strategy)
    run_logps(out, distributed)
    run_sft(out, distributed)
    run_sft_resumed(out, distributed, resume and resume / "sft-step-2")
    run_grpo(out, distributed)
    run_ppo(out, distributed)
    if strategy == "fsdp":  # what the sharded strategy must also keep working (DDP's own tests cover them there)
        run_grpo_resumed(out, distributed, resume and resume / "grpo-step-2")
        run_ppo(out, distributed, (resume or out) / "ppo-step-2")
        run_grpo_lora(out, distributed)
    run_reward_model(out, distributed)


if __name__ == "__main__":
    from grpo.training.distributed import exit_process

    startup.imports_done()
    run_all(Path(sys.argv[1]), *sys.argv[2:3], *[Path(a) for a in sys.argv[3:4]])
    exit_process()
