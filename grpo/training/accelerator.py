"""One Accelerator per training loop, whatever the loop before it asked for, and the fp32 GEMM plan its processes share.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs
from accelerate.state import AcceleratorState

from grpo.configs.distributed import COLLECTIVE_TIMEOUT
from grpo.training.precision import choose_precision, emulated_bf16_warning, this_machine


def make_accelerator(mixed_precision: str, gradient_accumulation_steps: int = 1) -> Accelerator:
    """An Accelerator with these settings, even if an earlier stage in this process used others.

    `mixed_precision` is the config's (`auto`, `bf16`, `fp16`, `no`), resolved here against the hardware
    (`grpo.training.precision`); the Accelerator's `mixed_precision` is the answer, which the loops pass on.
    Accelerate keeps its state process-global and refuses a second, different mixed-precision setting; the
    pipeline runs several stages in one process (cold-start SFT in bf16, then GRPO in fp32, say), so each loop
    starts from a clean state. Under `accelerate launch` the distributed setup is re-read from the environment
    (gloo on CPU, NCCL on GPU; `grpo.training.distributed` says how the loops split their batches).
    """
    hw = this_machine()
    precision = choose_precision(mixed_precision, hw)
    slow = emulated_bf16_warning(mixed_precision, hw)
    if slow:  # once per process: the warnings module shows a given message once
        warnings.warn(slow, RuntimeWarning)
    AcceleratorState._reset_state(reset_partial_state=True)
    # DDP's buffer broadcast in every forward would tie the processes' forward counts together (sampling and
    # reference passes differ per process); the models' buffers (rotary frequencies) never change anyway
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    # the loops' batch sizes are global (each process takes its share), so the prepared scheduler steps once per
    # optimizer step, not once per process as it would for per-process batches
    global_batches = DataLoaderConfiguration(split_batches=True)
    # a collective that waits longer than this (a process died, a link hung) fails the loop instead of hanging it,
    # so the stage can be retried (the launcher sets it from the stage's distributed.collective_timeout_s)
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=float(os.environ.get(COLLECTIVE_TIMEOUT, "1800"))))
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=gradient_accumulation_steps,
                       cpu=hw.device != "cuda", kwargs_handlers=[ddp, group], dataloader_config=global_batches)


def shared_gemm_plan(acc: Accelerator, setting: str, model: torch.nn.Module, tokens: int, output_dir):
    """The loop's fp32 GEMM plan (grpo.kernels.gemm): measured on the main process and sent to the others, so
    every process runs the same kernels; written to `output_dir` for the stage to log, and carried by each
    checkpoint. A resumed run, in its folder or from a checkpoint restored elsewhere, goes on with the kernels it
    started with where the CPU is the same (grpo.kernels.gemm.resumed_plan)."""
    from accelerate.utils import broadcast_object_list

    from grpo.kernels.gemm import load_plan, loop_plan, resumed_plan
    from grpo.training.checkpoints import latest_checkpoint

    plans = [None]
    if acc.is_main_process:
        newest = latest_checkpoint(Path(output_dir) / "checkpoints")
        held = load_plan(output_dir) or (load_plan(newest) if newest is not None else None)
        plans = [resumed_plan(held, setting) or
                 loop_plan(setting, model, tokens, acc.mixed_precision, acc.device.type)]
    if acc.num_processes > 1:
        broadcast_object_list(plans)
    if acc.is_main_process:
        plans[0].save(output_dir)
    return plans[0]
