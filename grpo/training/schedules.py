"""Learning-rate schedules by name: transformers' `get_scheduler` for the names in `grpo.configs.training.LR_SCHEDULERS`.

The same multipliers as transformers' (a test compares them step by step), written here because importing
`transformers.optimization` imports `transformers.trainer_utils`, which imports peft where it is installed, and peft
imports bitsandbytes: every stage would load both, and bitsandbytes warns about kernels no recipe asked for. peft
is loaded where a recipe asks for LoRA (grpo.training.lora), bitsandbytes for `optimizer: adamw_8bit`.
Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from grpo.configs.training import LR_SCHEDULERS


def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def _constant(step: int, *, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int, total: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # half a cosine wave, as transformers' default


def _cosine_with_restarts(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    # transformers' default is one cycle, so this is the cosine that reaches 0 at the end and stays there
    return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0))))


def _polynomial(step: int, *, warmup: int, total: int, lr_init: float, lr_end: float = 1e-7) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    if step > total:
        return lr_end / lr_init  # LambdaLR multiplies by the initial rate
    remaining = 1 - (step - warmup) / (total - warmup)
    return ((lr_init - lr_end) * remaining + lr_end) / lr_init  # power 1, as transformers' default


def _inverse_sqrt(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    timescale = warmup or 10_000
    return 1.0 / math.sqrt((step + timescale - warmup) / timescale)


_MULTIPLIERS = {"linear": _linear, "cosine": _cosine, "cosine_with_restarts": _cosine_with_restarts,
                "polynomial": _polynomial, "constant": _constant, "constant_with_warmup": _constant_with_warmup,
                "inverse_sqrt": _inverse_sqrt}
assert tuple(_MULTIPLIERS) == LR_SCHEDULERS, "grpo.configs.training.LR_SCHEDULERS names these schedules"


def make_scheduler(name: str, optimizer: Optimizer, num_warmup_steps: int, num_training_steps: int) -> LambdaLR:
    """The schedule `name` over `num_training_steps` optimizer steps, the first `num_warmup_steps` a linear warmup."""
    extra = {}
    if name == "polynomial":
        lr_init = optimizer.defaults["lr"]
        if not lr_init > 1e-7:  # transformers refuses it too: the decay would climb, not fall
            raise ValueError(f"lr_scheduler: polynomial decays to 1e-7, so the learning rate ({lr_init}) must be "
                             f"above it")
        extra["lr_init"] = lr_init
    # a partial, as transformers builds them, so checkpoints saved before this module resume the same way
    multiplier = partial(_MULTIPLIERS[name], warmup=num_warmup_steps, total=num_training_steps, **extra)
    return LambdaLR(optimizer, multiplier)
