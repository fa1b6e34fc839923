"""The samplers a stage's `rollout` section asks for, started: the one place that reads `rollout.launcher` and
`rollout.devices` and picks a transport.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch

from grpo.configs.rollout import RolloutConfig
from grpo.training.rollouts.base import Rollouts
from grpo.training.rollouts.protocol import Plan


def start_rollouts(cfg: RolloutConfig, plan: Plan, model: torch.nn.Module, tokenizer, *, first_step: int,
                   version: int, timeout_s: float, device: torch.device, local_processes: int = 1,
                   local_index: int = 0) -> Rollouts:
    """`cfg.workers` samplers of `model` (pushed as `version`) sampling `plan`'s steps from `first_step` on, started:
    Ray actors with `launcher: ray` (on the cluster's devices), else processes on this machine, on `cfg.devices` or,
    on a GPU machine, the GPUs after the `local_processes` trainer processes' own (`local_index`'s share), in turn,
    else the trainer's `device`. A device this machine lacks fails here, before any worker starts."""
    if cfg.launcher == "ray":  # actors on the cluster: its devices, not this machine's
        from grpo.training.rollouts.ray_actors import RayRollouts

        rollouts: Rollouts = RayRollouts(cfg, plan, model, tokenizer, first_step=first_step, timeout_s=timeout_s,
                                         device=str(device))
    else:
        from grpo.training.rollouts.processes import ProcessRollouts

        spare = [f"cuda:{i}" for i in range(local_processes, torch.cuda.device_count())]
        first = local_index * cfg.workers
        devices = cfg.devices or tuple(
            spare[first + w] if device.type == "cuda" and first + w < len(spare) else str(device)
            for w in range(cfg.workers))
        for d in devices:  # a device this machine lacks fails here, not as workers dying one after another
            kind, _, index = d.partition(":")
            if kind not in ("cpu", "cuda") or (kind == "cuda" and int(index or 0) >= torch.cuda.device_count()):
                raise ValueError(f"grpo.rollout.devices names {d!r}; this machine has cpu and "
                                 f"{torch.cuda.device_count()} CUDA device(s) (cuda:0 ...)")
        rollouts = ProcessRollouts(cfg, plan, model, tokenizer, first_step=first_step, timeout_s=timeout_s,
                                   devices=devices, trainers_here=local_processes)
    rollouts.start(model, version)
    return rollouts
