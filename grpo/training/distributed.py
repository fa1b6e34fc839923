"""Training across processes: what each process takes of a global batch, and what is reduced across them.

Under `accelerate launch --num_processes N` (DDP: gloo on CPU, NCCL on GPU) every loop runs in N processes holding
the same weights, and DDP averages the gradients of their backward passes. The settings keep their one-process
meaning, the *global* batch:

- SFT and the reward model: each process takes its contiguous 1/N of every (micro-)batch's rows (`process_share`),
  so N processes see the rows one process would.
- GRPO: each process samples `prompts_per_step / N` prompts x G completions. A group never straddles two
  processes, so group advantages need no communication; each process draws its own completions (`sampling_seed`).
- Loss normalisations over the whole batch are made global before the backward (`process_weight`): DDP's mean
  over processes then equals the one-process gradient at the same global batch, whatever each process's share of
  tokens (SFT's and DAPO's token means) or of padded width (Dr. GRPO).
- Metrics are reduced across processes before they are reported (`reduce_metrics`); only the main process reports,
  saves the final model and writes checkpoint markers, the others wait for it (`main_only`).

With one process every function here is the identity (weights 1.0 exactly), so single-process results do not move.
Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import math
import os
import sys
from typing import NoReturn, Sequence, TypeVar

import pandas as pd
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

T = TypeVar("T")


def check_split(what: str, size: int, num_processes: int) -> None:
    """Each process takes `size / num_processes` of `what`: refuse a size that does not split evenly."""
    if num_processes > 1 and size % num_processes:
        raise ValueError(f"{what}={size} cannot be split across {num_processes} processes (each takes an equal "
                         f"share of the global batch); make it a multiple of {num_processes}")


def process_share(acc: Accelerator, items: Sequence[T]) -> list[T]:
    """This process's contiguous share of `items` (all of them in one process); the length must split evenly."""
    return index_share(items, acc.process_index, acc.num_processes)


def local_processes(acc: Accelerator) -> int:
    """The training processes on this machine (torchrun's LOCAL_WORLD_SIZE; all of them where it is not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", acc.num_processes))


def index_share(items: Sequence[T], index: int, n: int) -> list[T]:
    """Process `index` of `n`'s contiguous share of `items` (`process_share`, for who knows the numbers only)."""
    if n == 1:
        return list(items)
    check_split("the batch", len(items), n)
    k = len(items) // n
    return list(items[index * k : (index + 1) * k])


def sampling_seed(seed: int, step: int, process_index: int) -> int:
    """The RNG seed of a GRPO step's sampling: the one-process seed on process 0, a stream of its own elsewhere."""
    return seed * 1_000_003 + step + process_index * 2**40


def main_only(acc: Accelerator):
    """`with main_only(acc) as main: if main: ...`: work for the main process alone (saving), between two barriers,
    so the others neither read what it has not finished writing nor run ahead."""
    return _MainOnly(acc)


class _MainOnly:
    def __init__(self, acc: Accelerator):
        self.acc = acc

    def __enter__(self) -> bool:
        self.acc.wait_for_everyone()
        return self.acc.is_main_process

    def __exit__(self, *exc) -> None:
        if exc[0] is None:  # a failing process skips it and exits; the launcher then stops the others
            self.acc.wait_for_everyone()


def matched_chunks(acc: Accelerator, chunks: list[slice]) -> list[tuple[slice, bool]]:
    """`(rows, counts)` for each micro-batch, padded so that every process runs as many forward/backward passes.

    DDP all-reduces the gradients in every backward: a process with fewer micro-batches than the others (dynamic
    sampling short of groups) would leave them waiting. It repeats its last micro-batch with `counts=False`, whose
    loss is multiplied by zero.
    """
    if acc.num_processes == 1 or not chunks:
        return [(s, True) for s in chunks]
    most = int(acc.gather(torch.tensor([len(chunks)], device=acc.device)).max())
    return [(s, True) for s in chunks] + [(chunks[-1], False)] * (most - len(chunks))


def process_weight(acc: Accelerator, loss_type: str, completion_mask: torch.Tensor) -> float:
    """The factor on this process's GRPO loss that makes DDP's mean over processes the global batch's loss.

    The trainer's loss on one process is its own batch's (its rows, its tokens, its padded width); the
    one-process loss at the same global batch normalises by the global figures. With n rows, t tokens and width w
    here and N, T, W over all P processes, DDP's 1/P mean needs: grpo and bnpo (means over rows, and over
    micro-batches of equal rows) P·n/N; dapo (token mean) P·t/T; dr_grpo (token sum over rows x width)
    P·n·w/(N·W). With equal rows per process grpo and bnpo give exactly 1.
    """
    P = acc.num_processes
    if P == 1:
        return 1.0
    mine = torch.tensor([completion_mask.size(0), float(completion_mask.sum()), completion_mask.size(1)],
                        dtype=torch.float64, device=acc.device)  # [3] rows, tokens, width
    every = acc.gather(mine).view(P, 3)  # [P, 3]
    rows, tokens, width = mine.tolist()
    all_rows, all_tokens, max_width = every[:, 0].sum().item(), every[:, 1].sum().item(), every[:, 2].max().item()
    if loss_type == "dapo":
        return P * tokens / max(all_tokens, 1.0)
    if loss_type == "dr_grpo":
        return P * rows * width / (all_rows * max_width)
    return P * rows / all_rows


def reduce_sum(acc: Accelerator, value: float) -> float:
    """The sum of `value` over the processes (the value itself in one process)."""
    if acc.num_processes == 1:
        return value
    return acc.reduce(torch.tensor([value], dtype=torch.float64, device=acc.device), "sum").item()


# How each metric combines across processes; anything not named is the mean over processes that have it (each
# process holds an equal share of rows, so a mean of means is the global mean), NaN ignored.
SUMMED = ("reward_failures/", "reward_skipped/", "reward_ungraded/", "reward_figures/", "tokens_per_s", "dynamic/groups")
MAXED = ("time/",)


def reduce_metrics(acc: Accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """Metrics of the whole global batch from each process's own (call on every process; each gets the result)."""
    if acc.num_processes == 1:
        return metrics
    every = gather_object([metrics])  # a dict per process; keys may differ (a reward that skipped rows here)
    out = {}
    for key in dict.fromkeys(k for m in every for k in m):
        values = [float(m[key]) for m in every if key in m]
        finite = [v for v in values if not math.isnan(v)]
        if key.startswith(SUMMED):
            out[key] = sum(finite)
        elif key.startswith(MAXED):
            out[key] = max(finite, default=math.nan)
        else:
            out[key] = sum(finite) / len(finite) if finite else math.nan
    return out


def gather_table(acc: Accelerator, table: pd.DataFrame) -> pd.DataFrame:
    """Every process's rows of a table, in process order (the table itself in one process)."""
    if acc.num_processes == 1:
        return table
    return pd.concat(gather_object([table]), ignore_index=True)


def end_process_group() -> None:
    """Tear this process's process group down before it exits, once its loop has finished: every rank waits for the
    others (no collective of a peer's still in flight), the objects that hold the group (a DDP reducer, FSDP's
    states) are collected, then the group is destroyed. Left to the interpreter's exit, gloo's threads were sometimes
    destroyed while joinable: "terminate called without an active exception", SIGABRT, and `accelerate launch`
    failed a job whose training had finished (seen in CI's DDP and DPO tests)."""
    import gc

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        gc.collect()
        torch.distributed.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """End a launched training process whose work is done and written: its process group torn down, its output and
    logs flushed, then out at once, without the interpreter's teardown (where C++ threads that torch or gloo left
    behind could still abort a finished job, see `end_process_group`)."""
    import logging

    end_process_group()
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
