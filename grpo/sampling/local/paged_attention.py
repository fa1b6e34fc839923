"""Decode attention over a paged KV cache that reads each slot's own pages, as far as that slot has written.

The captured layout of `pages.PagedState` (`layout="kernel"`, the one CUDA graphs replay): one query token a slot,
[S, Hkv, G, D] (G query heads share a KV head), against keys and values kept in pages of a pool ([Hkv, pages x
page, D] a layer), a block table per slot ([S, pages a row]) and, per slot on the device, `plen` (its prefix's
valid positions), `start` (where its own tokens begin: a page boundary) and `at` (its newest token's position; -1
for a slot that reads nothing). A slot reads positions [0, plen) and [start, at], and no other.

- On CUDA, `_paged_decode` (Triton): one program per (slot, KV head) walks that slot's pages `BLOCK` positions at a
  time up to its own `at`, with an online softmax over the G heads of the group at once (a [G, D] x [D, BLOCK]
  product), so a step's K/V reads follow the rows' lengths, not the longest row's and not the budget. Its loop
  bound is read from the device, so a captured graph replays it as the rows grow. Chosen over gathering the pages
  into rows for SDPA (a copy of every slot's K/V each step, as wide as the longest live row, whose width a graph
  would have to fix at the budget) and over FlexAttention (a compiled block mask per shape; the decode step is
  already a graph per row bucket).
- Elsewhere (a CPU, or torch without Triton), `reference`: the same arithmetic in torch over the first kv_len
  positions of every slot's table, what the tests compare the kernel with (`TRITON_INTERPRET=1` runs the kernel on
  a CPU).

Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None

BLOCK = 64  # positions a program reads at a time (four 16-position pages)


def kernel_runs_on(device: torch.device) -> bool:
    """Whether `_paged_decode` runs for tensors on `device`: CUDA with Triton, or Triton's interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, plen: torch.Tensor,
                 start: torch.Tensor, at: torch.Tensor, scale: float, page: int, kv_len: int | None = None,
                 use_kernel: bool | None = None) -> torch.Tensor:
    """Attention of q [S, Hkv, G, D] over each slot's own positions in the pools ([Hkv, pages x page, D] each):
    [S, Hkv, G, D]. kv_len: positions the torch path reads at most (a multiple of `page`; None: the whole table)."""
    if use_kernel is None:
        use_kernel = kernel_runs_on(q.device)
    if use_kernel:
        return _launch(q, k_pool, v_pool, table, plen, start, at, scale, page)
    return reference(q, k_pool, v_pool, table, plen, start, at, scale, page, kv_len)


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, plen: torch.Tensor,
              start: torch.Tensor, at: torch.Tensor, scale: float, page: int,
              kv_len: int | None = None) -> torch.Tensor:
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
    return out.masked_fill((at < 0).view(S, 1, 1, 1), 0.0)  # a slot that reads nothing gives zeros, as the kernel


def _launch(q, k_pool, v_pool, table, plen, start, at, scale, page):
    S, Hkv, G, D = q.shape
    if D & (D - 1) or D < 16:
        raise ValueError(f"the paged decode kernel needs a power-of-two head size of 16 or more, got {D}")
    if BLOCK % page:
        raise ValueError(f"a page of {page} positions does not divide the kernel's block of {BLOCK}")
    out = torch.empty(S, Hkv, G, D, dtype=q.dtype, device=q.device)  # [S, Hkv, G, D]
    k_pool, v_pool, table = k_pool.contiguous(), v_pool.contiguous(), table.contiguous()
    _paged_decode[(S, Hkv)](
        q, k_pool, v_pool, out, table, plen, start, at,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_pool.stride(0), table.stride(0), scale,
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, PAGE=page, BLOCK=BLOCK, IEEE=q.dtype == torch.float32)
    return out


if triton is not None:

    @triton.jit
    def _paged_decode(Q, K, V, O, TABLE, PLEN, START, AT, stride_qs, stride_qh, stride_qg, stride_os, stride_oh,
                      stride_og, stride_kh, stride_ts, scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                      PAGE: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
        s = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        heads = g[:, None] < G
        q = tl.load(Q + s * stride_qs + h * stride_qh + g[:, None] * stride_qg + d[None, :], mask=heads, other=0.0)
        at = tl.load(AT + s)
        plen = tl.load(PLEN + s)
        start = tl.load(START + s)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        k_head = K + h * stride_kh
        v_head = V + h * stride_kh
        for b in range(0, tl.cdiv(at + 1, BLOCK)):  # the slot's own positions, a block at a time
            pos = b * BLOCK + tl.arange(0, BLOCK)
            valid = (pos < plen) | ((pos >= start) & (pos <= at))
            page = tl.load(TABLE + s * stride_ts + pos // PAGE, mask=pos <= at, other=0)
            flat = page * PAGE + pos % PAGE  # [BLOCK] into the pool's positions
            k = tl.load(k_head + flat[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK, D]
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # [GP, BLOCK]
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: no NaN from -inf - -inf
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + flat[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK, D]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(O + s * stride_os + h * stride_oh + g[:, None] * stride_og + d[None, :],
                 out.to(O.dtype.element_ty), mask=heads)
