"""The Triton kernel behind `paged_attention.paged_decode`: one program per (slot, KV head) walks that slot's pages
`BLOCK` positions at a time up to its own newest position, with an online softmax over the G query heads of the
group at once (a [G, D] x [D, BLOCK] product). Its loop bound is read from the device, so a captured graph replays
it as the rows grow.

Imported only where the kernel runs (CUDA, or Triton's interpreter on a CPU: `TRITON_INTERPRET=1` set before Triton
is first imported), so a process that never runs it never loads Triton. Must not depend on Prefect or MLflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # positions a program reads at a time (four 16-position pages)


def launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, plen: torch.Tensor,
           start: torch.Tensor, at: torch.Tensor, scale: float, page: int, read: torch.Tensor | None) -> torch.Tensor:
    """`paged_attention.paged_decode` on the kernel: [S, Hkv, G, D]. read: [S] int64 or None; where given, each
    slot's count of the positions it read is added to it."""
    S, Hkv, G, D = q.shape
    if D & (D - 1) or D < 16:
        raise ValueError(f"the paged decode kernel needs a power-of-two head size of 16 or more, got {D}")
    if BLOCK % page:
        raise ValueError(f"a page of {page} positions does not divide the kernel's block of {BLOCK}")
    out = torch.empty(S, Hkv, G, D, dtype=q.dtype, device=q.device)  # [S, Hkv, G, D]
    k_pool, v_pool, table = k_pool.contiguous(), v_pool.contiguous(), table.contiguous()
    _paged_decode[(S, Hkv)](
        q, k_pool, v_pool, out, table, plen, start, at, at if read is None else read,
        q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1), out.stride(2),
        k_pool.stride(0), table.stride(0), scale,
        G=G, GP=max(16, triton.next_power_of_2(G)), D=D, PAGE=page, BLOCK=BLOCK, IEEE=q.dtype == torch.float32,
        COUNT=read is not None)
    return out


@triton.jit
def _paged_decode(Q, K, V, O, TABLE, PLEN, START, AT, READ, stride_qs, stride_qh, stride_qg, stride_os, stride_oh,
                  stride_og, stride_kh, stride_ts, scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr, COUNT: tl.constexpr):
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
    n_read = tl.zeros([BLOCK], tl.int64)  # positions loaded, per lane of the block
    k_head = K + h * stride_kh
    v_head = V + h * stride_kh
    for b in range(0, tl.cdiv(at + 1, BLOCK)):  # the slot's own positions, a block at a time
        pos = b * BLOCK + tl.arange(0, BLOCK)
        valid = (pos < plen) | ((pos >= start) & (pos <= at))
        n_read += valid.to(tl.int64)
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
    tl.store(O + s * stride_os + h * stride_oh + g[:, None] * stride_og + d[None, :], out.to(O.dtype.element_ty),
             mask=heads)
    if COUNT:
        if h == 0:  # every KV head reads the same positions: the first counts them for the slot
            tl.store(READ + s, tl.load(READ + s) + tl.sum(n_read, 0))
