"""Each row's random stream, counter-based: the uniform for a row's token k is a hash of (the row's stream, k).

A row gets one 64-bit stream when it is submitted (drawn from torch's generator, so `torch.manual_seed` still fixes a
run), and its draws are computed as it decodes, on the device, inside a captured step: nothing of size [rows,
budget] is drawn up front. A row's tokens depend on its prompt and its stream alone: not on its slot, its neighbours,
a preemption, or the budget (a 16k budget samples the same tokens as a 512 one for a row that ends within 512).

The hash is SplitMix64's output function over the stream's k-th state (stream + (k + 1) * golden gamma): 64 bits
that pass BigCrush (Steele, Lea and Flood, 2014), of which the top 53 make a float64 in [0, 1). Plain int64 tensor
ops, which wrap on overflow on CPU and CUDA alike, with logical right shifts spelled out (torch's are arithmetic).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch

_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # the constants as int64 (two's complement)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """A logical right shift of int64 `x` by `s` bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniform_at(streams: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    """The draw in [0, 1) of token `k` of each row: streams [B] int64, k [B] int64 or one int; float64 [B]."""
    if isinstance(k, int):
        step = ((k + 1) * _GAMMA) % (1 << 64)
        z = streams + (step - (1 << 64) if step >= 1 << 63 else step)
    else:
        z = streams + (k + 1).mul(_GAMMA)
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * 2.0**-53


def draw_streams(n: int, device: torch.device | str = "cpu", per: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """n rows' streams [n] int64 from torch's generator on `device` (or `generator`), drawn `per` rows at a time: a
    batch of `per` rows that the step-by-step decode loop (`backend.sample_batch`) draws for itself, so a seed gives
    the same streams whether rows are sampled a batch at a time or streamed through slots."""
    per = per or n
    out = [torch.randint(-(1 << 63), (1 << 63) - 1, (min(per, n - i),), dtype=torch.int64, device=device,
                         generator=generator) for i in range(0, n, per)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=device)
