"""Supervised fine-tuning with the loss on response tokens only.

The loop is plain and visible: tokenize every row up front (so a row that cannot fit fails before any training; a
Parquet dataset once, each process of a launch its share, into Arrow files the loop reads a row at a time:
`grpo.training.sft_rows`),
draw batches by step number (so a resumed run sees exactly the batches it would have seen), and step through
Hugging Face Accelerate, which handles device placement, mixed precision, gradient accumulation and multi-GPU
launches (under `accelerate launch --num_processes N` each process takes 1/N of every batch's rows and the loss
stays the token mean over the whole batch: `grpo.training.distributed`). A micro-batch goes through the model as one
row without padding where `packing` allows, and in pieces of whole rows up to `max_tokens_per_microbatch` tokens where
the recipe sets one (a memory bound: each piece's loss weighted by its share of the micro-batch's response tokens, so
the step's loss and gradient are the same). Every `checkpoint_every` steps the model, optimizer, scheduler and RNG
state are saved; a run that finds a checkpoint in its output folder resumes from it and loses at most the steps since.

Must not depend on Prefect or MLflow: metrics go to a callback.
"""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.configs.distributed import DistributedConfig
from grpo.configs.training import SFTConfig
from grpo.data.tables import DataError
from grpo.kernels.attention import PACKED, attending_packed, cpu_attention
from grpo.kernels.gemm import fp32_gemm
from grpo.kernels.mlp import compact_mlp
from grpo.models import activation_checkpointing
from grpo.training.accelerator import make_accelerator, shared_gemm_plan
from grpo.training.batches import batch_indices
from grpo.training.checkpoints import load_newest_checkpoint, save_checkpoint
from grpo.training.distributed import check_split, main_only, matched_chunks, process_share, reduce_sum
from grpo.training.logprobs import packing_on
from grpo.training.optimizers import make_adamw, optimizer_step
from grpo.training.packing import pack_examples, pack_in_order
from grpo.training.schedules import make_scheduler
from grpo.training.sft_rows import Example, token_counts, tokenize_rows, tokenized  # noqa: F401 (tokenize_rows)
from grpo.training.strategy import make_strategy

MetricsCallback = Callable[[int, dict[str, float]], None]


class SFTResult(NamedTuple):
    model_dir: Path  # the final model, loadable with from_pretrained
    steps: int  # optimizer steps taken in total (including resumed ones)
    final_loss: float  # mean training loss over the last logging window


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id)  # [B, T] right-padded
    labels = torch.full((len(batch), width), -100)  # [B, T]
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
    for i, e in enumerate(batch):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[i, : len(e.labels)] = torch.tensor(e.labels)
        mask[i, : len(e.input_ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def check_row_budget(lengths: list[int], max_tokens: int | None, source: str) -> None:
    """A token budget must hold every row (`lengths`: each row's tokens): else an error naming the longest, before
    any training."""
    if max_tokens is None:
        return
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] > max_tokens:
        raise DataError(f"{source}: row {longest} is {lengths[longest]} tokens, more than "
                        f"max_tokens_per_microbatch={max_tokens}; raise it to at least that (or to max_seq_len)")


def row_pieces(rows: list[Example], max_tokens: int | None) -> list[list[int]]:
    """A micro-batch's rows in pieces of whole rows, in order, of at most `max_tokens` tokens each (`pack_in_order`),
    or one piece of all of them without a budget."""
    if max_tokens is None:
        return [list(range(len(rows)))]
    return pack_in_order([len(e.input_ids) for e in rows], max_tokens)


def model_inputs(rows: list[Example], packed: bool, model: PreTrainedModel, pad_id: int,
                 device: torch.device) -> dict:
    """The model's inputs for some rows: one packed row (its sequences as `packed_segments` where the model attends
    with `packed_attention`, else read from the position ids) or a right-padded batch."""
    collated = (pack_examples([e.input_ids for e in rows], [e.labels for e in rows]) if packed
                else collate(rows, pad_id))
    if packed and model.config._attn_implementation != PACKED:  # sequences from the position ids
        collated.pop("packed_segments")
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in collated.items()}


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: pd.DataFrame | Sequence[str | Path],
    cfg: SFTConfig,
    output_dir: str | Path,
    on_metrics: MetricsCallback | None = None,
    *,
    source: str = "dataset",
    progress: bool = True,
    distributed: DistributedConfig | None = None,
) -> SFTResult:
    """Fine-tune `model` on `rows` (`prompt`, `response`) and save it to `output_dir/model`; resumes if it can.

    `rows`: a frame, or Parquet files or folders of them (read in order as one table), tokenized once into
    `output_dir/tokens` (each process its share) and read from there a row at a time: the same batches either way.

    `distributed`: the stage's section; its strategy (ddp or fsdp) decides how the processes hold the model."""
    output_dir = Path(output_dir)
    ckpt_root = output_dir / "checkpoints"
    # fails before any training
    examples = tokenized(rows, tokenizer, cfg.max_seq_len, output_dir / "tokens", source)
    # the tokens the loss counts in each row (the model shifts labels by one): a batch's token mean across processes
    lengths, label_tokens = token_counts(examples)
    check_row_budget(lengths, cfg.max_tokens_per_microbatch, source)  # so does a row past the token budget
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    acc = make_accelerator(cfg.mixed_precision, cfg.grad_accum_steps)
    strategy = make_strategy(acc, distributed)
    check_split("batch_size", cfg.batch_size, acc.num_processes)  # batch_size is the global micro-batch
    optimizer = make_adamw(model, cfg.learning_rate, cfg.weight_decay)
    scheduler = make_scheduler(cfg.lr_scheduler, optimizer, num_warmup_steps=cfg.warmup_steps,
                               num_training_steps=cfg.max_steps)
    model, optimizer, scheduler = strategy.prepare(model, optimizer, scheduler)

    start = load_newest_checkpoint(acc, ckpt_root, strategy.load_state)  # 0: no checkpoint to trust, it starts over
    # fp32 on a CPU: the faster GEMM library of each of a linear's GEMMs, measured at a micro-batch's tokens
    row_tokens = sum(lengths[:256]) / min(len(lengths), 256)
    gemm = shared_gemm_plan(acc, cfg.fp32_gemm, acc.unwrap_model(model),
                            max(1, round(row_tokens * cfg.batch_size / acc.num_processes)), output_dir)

    unwrapped = acc.unwrap_model(model)
    # each micro-batch as one row without padding, where the model's attention takes it exactly
    packed = packing_on(cfg.packing, unwrapped)
    model.train()
    window: list[float] = []
    last_loss = math.nan
    bar = tqdm(total=cfg.max_steps, initial=start, desc="sft", disable=not progress or not acc.is_main_process,
               mininterval=2.0)
    # faster attention on CPU and one tensor less per MLP kept for the backward; the same numbers
    with (cpu_attention(unwrapped), compact_mlp(unwrapped), fp32_gemm(unwrapped, gemm),
          attending_packed(unwrapped, packed), activation_checkpointing(unwrapped, cfg.gradient_checkpointing)):
        for step in range(start, cfg.max_steps):
            for micro in range(cfg.grad_accum_steps):
                idx = batch_indices(len(examples), cfg.batch_size, step * cfg.grad_accum_steps + micro, cfg.seed)
                mine = process_share(acc, idx)  # all of idx in one process
                rows = [examples[i] for i in mine]
                # this process's rows in pieces of at most the token budget (all of them without one), as many on
                # every process (a piece that does not count weighs 0); each piece's loss is its token mean
                pieces = matched_chunks(acc, row_pieces(rows, cfg.max_tokens_per_microbatch))
                batch_tokens = sum(label_tokens[i] for i in idx)
                loss_sum = 0.0
                with strategy.accumulate(model):
                    for j, (piece, counts) in enumerate(pieces):
                        part = [rows[k] for k in piece]
                        # the piece's share of the batch's response tokens: 1.0 for a whole batch in one process
                        share = sum(label_tokens[mine[k]] for k in piece) / batch_tokens * float(counts)
                        # gradients sync in the step's last micro-batch, at its last piece
                        with strategy.no_sync(model, last=acc.sync_gradients and j == len(pieces) - 1):
                            loss = model(**model_inputs(part, packed, unwrapped, tokenizer.pad_token_id,
                                                        acc.device)).loss  # mean over the piece's response tokens
                            # DDP averages over processes: x N x share makes it the token mean over the whole batch
                            acc.backward(loss * (acc.num_processes * share))
                        loss_sum += loss.item() * share
                    grad_norm = optimizer_step(acc, model, optimizer, scheduler, cfg.max_grad_norm)
                window.append(loss_sum)
            bar.update(1)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                last_loss = reduce_sum(acc, sum(window)) / len(window)  # every process's shares of each batch
                window.clear()
                bar.set_postfix(loss=f"{last_loss:.3f}")
                if on_metrics and acc.is_main_process:
                    on_metrics(done, {"train/loss": last_loss, "train/learning_rate": scheduler.get_last_lr()[0],
                                      "train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                                      "train/epoch": done * cfg.grad_accum_steps * cfg.batch_size / len(examples)})
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                save_checkpoint(acc, ckpt_root, done, cfg.keep_checkpoints, save_state=strategy.save_state)
    bar.close()

    model_dir = output_dir / "model"
    whole = strategy.whole_model(model)  # the whole weights, on the main process
    with main_only(acc) as main:
        if main:
            whole.save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            shutil.rmtree(ckpt_root, ignore_errors=True)  # the run finished: the final model supersedes its checkpoints
    return SFTResult(model_dir, cfg.max_steps, last_loss)
