"""Decode attention over a paged KV cache that reads each slot's own pages, as far as that slot has written.

The captured layout of `pages.PagedState` (`layout="kernel"`, the one CUDA graphs replay): one query token a slot,
[S, Hkv, G, D] (G query heads share a KV head), against keys and values kept in pages of a pool ([Hkv, pages x
page, D] a layer), a block table per slot ([S, pages a row]) and, per slot on the device, `plen` (its prefix's
valid positions), `start` (where its own tokens begin: a page boundary) and `at` (its newest token's position; -1
for a slot that reads nothing). A slot reads positions [0, plen) and [start, at], and no other.

- On CUDA, the Triton kernel (`paged_kernel`): one program per (slot, KV head) walks that slot's pages up to its
  own `at`, with an online softmax over the G heads of the group at once, so a step's K/V reads follow the rows'
  lengths, not the longest row's and not the budget. Its loop bound is read from the device, so a captured graph
  replays it as the rows grow. Chosen over gathering the pages into rows for SDPA (a copy of every slot's K/V each
  step, as wide as the longest live row, whose width a graph would have to fix at the budget) and over
  FlexAttention (a compiled block mask per shape; the decode step is already a graph per row bucket). Triton is
  imported only when the kernel runs.
- Elsewhere (a CPU, or torch without Triton), `reference`: the same arithmetic in torch over the first kv_len
  positions of every slot's table (what it gathers, every slot as wide as the widest): the kernel's oracle, and
  what the captured layout runs on a CPU in tests (the eager CPU step reads its own rows by length instead,
  `length_rows`). Triton's interpreter
  (`TRITON_INTERPRET=1` set before Triton is first imported) runs the kernel on a CPU:
  tests/grpo/sampling/local/test_paged_attention.py compares the two there.

Both count where they read: given `read` ([S] int64), each adds to it the positions it read for each slot (the
kernel: the positions it loaded, [0, plen) and [start, at]; the reference: every position it gathered).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None  # the CPU build of torch ships without Triton


def kernel_runs_on(device: torch.device) -> bool:
    """Whether the kernel (`paged_kernel`) runs for tensors on `device`: CUDA with Triton, or Triton's interpreter."""
    if not _HAS_TRITON:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, plen: torch.Tensor,
                 start: torch.Tensor, at: torch.Tensor, scale: float, page: int, kv_len: int | None = None,
                 use_kernel: bool | None = None, read: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [S, Hkv, G, D] over each slot's own positions in the pools ([Hkv, pages x page, D] each):
    [S, Hkv, G, D]. kv_len: positions the torch path reads at most (a multiple of `page`; None: the whole table).
    read: [S] int64 or None; where given, the positions read for each slot are added to it."""
    if use_kernel is None:
        use_kernel = kernel_runs_on(q.device)
    if use_kernel:
        from grpo.sampling.local.paged_kernel import launch  # loads Triton: only where the kernel runs

        return launch(q, k_pool, v_pool, table, plen, start, at, scale, page, read)
    return reference(q, k_pool, v_pool, table, plen, start, at, scale, page, kv_len, read)


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, plen: torch.Tensor,
              start: torch.Tensor, at: torch.Tensor, scale: float, page: int,
              kv_len: int | None = None, read: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_decode` in torch: each slot's first kv_len // page pages gathered into a row, its positions outside
    [0, plen) and [start, at] masked, one SDPA over the rows."""
    S, Hkv, G, D = q.shape
    n_pages = table.size(1) if kv_len is None else min(table.size(1), -(-kv_len // page))
    index = table[:, :n_pages].flatten()  # [S * n]
    rows = []
    for pool in (k_pool, v_pool):
        got = pool.view(Hkv, -1, page * D).index_select(1, index)  # [Hkv, S * n, page * D]
        rows.append(got.view(Hkv, S, n_pages * page, D).transpose(0, 1))  # [S, Hkv, L, D]
    pos = torch.arange(n_pages * page, device=q.device)[None]  # [1, L]
    valid = (pos < plen[:, None]) | ((pos >= start[:, None]) & (pos <= at[:, None]))  # [S, L]
    bias = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, torch.finfo(q.dtype).min)
    out = torch.nn.functional.scaled_dot_product_attention(q, rows[0], rows[1], attn_mask=bias[:, None, None],
                                                           scale=scale)
    if read is not None:
        read += n_pages * page  # every slot's gathered row, masked or not
    return out.masked_fill((at < 0).view(S, 1, 1, 1), 0.0)  # a slot that reads nothing gives zeros, as the kernel


