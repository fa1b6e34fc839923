"""The loops' optimizers and their step: AdamW (fused where torch has it) or bitsandbytes' 8-bit AdamW, stepping
the weights themselves or fp32 master copies of bf16 weights; the clip/step/zero sequence every loop shares.

bf16 weights with an fp32 optimizer (`weights_dtype: bfloat16`): the model, its gradients, the reference model and
sampling hold bf16, and `MasterWeights` keeps an fp32 copy of every trainable weight that the inner optimizer
steps (with fp32 state), writing the rounded result back into the model after each step. Stepping bf16 weights
directly would lose every update smaller than bf16's resolution (2^-8 of the weight: a learning rate of 1e-6
moves nothing). This is the bf16 mode of DeepSpeed and Megatron; TRL and accelerate instead keep fp32 weights and
autocast the forward to bf16 (`mixed_precision: bf16` here), which keeps the same fp32 optimizer but holds fp32
weights and gradients (and autocast's bf16 copies of the weights) in memory.

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.extras import require

if TYPE_CHECKING:
    from accelerate import Accelerator

# fp32 gradient bytes made at once in a MasterWeights step (or one parameter's, if larger): the step's peak extra
# memory, instead of an fp32 copy of every gradient (28 GB for a 7B model). Big enough that a step's few kernel
# launches per slice cost nothing next to the optimizer's own work.
STEP_SLICE_BYTES = 256 * 2**20


def make_adamw(model: torch.nn.Module | list[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters (or these tensors), as one fused kernel where torch has it.

    The fused step (CPU and CUDA) updates every tensor in one pass instead of a dozen elementwise ops per group of
    tensors: ~4x faster on a small model, where the optimizer step is a visible share of a training step.
    """
    params = [p for p in (model.parameters() if isinstance(model, torch.nn.Module) else model) if p.requires_grad]
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def optimizer_step(acc: Accelerator, model: torch.nn.Module, optimizer, scheduler,
                   max_grad_norm: float) -> torch.Tensor | None:
    """Clip, step and zero the gradients inside `acc.accumulate(model)`; the gradient norm on a syncing step, else None.

    Accelerate's prepared optimizer and scheduler skip their step on micro-batches that only accumulate.
    """
    grad_norm = acc.clip_grad_norm_(model.parameters(), max_grad_norm) if acc.sync_gradients else None
    if hasattr(grad_norm, "full_tensor"):  # sharded gradients (fsdp) give the norm as a DTensor
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def require_bitsandbytes() -> None:
    """Fail, saying what to install, when bitsandbytes (for `optimizer: adamw_8bit`) is not importable."""
    require(["bitsandbytes"], "optimizer: adamw_8bit", "pip install bitsandbytes", "set optimizer: adamw")


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, *, eight_bit: bool = False,
                   master_weights: bool = False) -> torch.optim.Optimizer:
    """AdamW (or 8-bit AdamW) over the model's trainable parameters; with `master_weights`, over fp32 copies of them.

    Build it before the model is cast to bf16, so the masters start from the weights' full precision.
    """
    params = [p for p in model.parameters() if p.requires_grad]

    def inner(targets: list[torch.Tensor]) -> torch.optim.Optimizer:
        if eight_bit:
            require_bitsandbytes()
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(targets, lr=lr, weight_decay=weight_decay)
        return make_adamw(targets, lr, weight_decay)

    if master_weights:
        return MasterWeights(params, inner)
    return inner(params)


class MasterWeights(torch.optim.Optimizer):
    """Steps fp32 master copies of the parameters with an inner optimizer, then copies them back, rounded.

    The parameters' gradients (in the model's dtype, accumulated over the micro-batches, clipped by the trainer) are
    upcast onto the masters a slice of about `slice_bytes` at a time: the inner optimizer steps the masters that
    have a gradient, which it updates one by one (AdamW and 8-bit AdamW keep a step count per parameter), so
    stepping slice by slice gives the numbers of one step over all of them. `param_groups` and `state` are the inner
    optimizer's (an LR scheduler drives it through them); `state_dict` carries the masters, so a resumed run
    continues from the fp32 weights, not the rounded ones.
    """

    def __init__(self, params: list[torch.nn.Parameter], make_inner, slice_bytes: int = STEP_SLICE_BYTES):
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]  # fp32 copies
        self.slices = _slices([m.numel() * 4 for m in self.masters], slice_bytes)
        self.inner = make_inner(self.masters)
        super().__init__(self.masters, dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups  # one set of groups: the scheduler's lr reaches the inner
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeights.step takes no closure")
        for part in self.slices:
            pairs = [(self.params[i], self.masters[i]) for i in part if self.params[i].grad is not None]
            if not pairs:
                continue
            for p, m in pairs:
                m.grad = p.grad.float()
            self.inner.step()  # steps this slice only: the other masters have no gradient
            for p, m in pairs:
                p.copy_(m)  # rounded to the model's dtype
                m.grad = None  # freed before the next slice is upcast

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state_dict["masters"]):
                m.copy_(saved)
                p.copy_(m)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def export_weights(self) -> None:
        """Put the fp32 masters into the model's parameters, which become fp32 (to save the trained model)."""
        for p, m in zip(self.params, self.masters):
            p.data = m.detach().clone()


def _slices(sizes: list[int], budget: int) -> list[range]:
    """Consecutive index ranges whose sizes sum to at most `budget` (a larger item alone).

    >>> _slices([3, 3, 3, 9, 1], 6)
    [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    """
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > budget:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters only, as `from_pretrained(dtype=...)` leaves them: buffers such as the
    rotary frequencies stay float32 (`model.to(dtype)` would round them too). The Parameter objects stay the same."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
