"""Completion-token log-probs (and entropy) from the last hidden states, without the [N, C, V] logits.

GRPO needs, per completion token, log p(token) under the policy at the sampling temperature, and (a metric, no
gradient) the entropy of that distribution. The plain way projects every position onto the whole vocabulary,
`logits = lm_head(hidden)` [N, C, V], upcasts to float32 and takes a log-softmax: with V = 151,936 that is 600 KB
per token, kept for the backward, and several copies of it at the peak (the float32 logits, the log-softmax output,
the entropy's temporaries, their gradients).

`selective_logps` gives the same numbers and gradients while holding one chunk of tokens' logits at a time. The
forward walks the flattened tokens in chunks and keeps only each token's logsumexp (4 bytes); the backward
recomputes each chunk's logits and turns them into gradients for the hidden states and the head's weight and bias
right away. The price is one more head matmul per chunk (the logits are not kept); a forward without gradient
(the reference model, pi_old) costs what the plain one does.

Matmul precision follows what the plain path would do: the logits are computed in the hidden states' dtype, or in
autocast's dtype when autocast is on (as `lm_head` would be under autocast), then upcast to float32 before the
temperature and the softmax.

A memory trick with the model's own numbers; must not depend on Prefect or MLflow (nor on transformers).
"""

from __future__ import annotations

import torch

F = torch.nn.functional

# Float32 logits of one chunk of tokens. The forward works in two buffers of this size (the logits and their
# log-softmax), the backward in one, plus the matmul's own output when it runs in bf16.
DEFAULT_CHUNK_BYTES = 128 * 2**20
# The head's weight gradient under bf16 autocast is accumulated in float32 from bf16 products: a block of this many
# float32 bytes of it at a time, not the whole [V, H] product and its float32 copy per chunk (0.76 GiB at
# Qwen2.5-0.5B's 151,936 x 896, more than the gradient itself; benchmarks/memory_pieces.py "head_backward")
WGRAD_BLOCK_BYTES = 32 * 2**20


def default_chunk_tokens(vocab_size: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk such that a chunk's float32 logits take about `budget_bytes`.

    >>> default_chunk_tokens(151_936)  # 128 MiB / (151,936 x 4 bytes)
    220
    """
    return max(1, budget_bytes // (vocab_size * 4))


def matmul_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype `lm_head(hidden)` would compute in: autocast's when autocast is on here, else the hidden's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return hidden.dtype


def selective_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    temperature: float, *, chunk_tokens: int | None = None,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((hidden @ weight.T + bias) / temperature) at `targets`, chunk by chunk; entropy if asked.

    hidden: [N, C, H] the states that predict each target (after the model's final norm); weight: [V, H] and
    bias: [V] or None, the output head (a tied embedding's weight is fine: it gets its gradient through autograd
    like any other input); targets: [N, C] token ids. temperature <= 0 means no division (as `token_logps`).
    chunk_tokens: tokens per chunk (default: about `DEFAULT_CHUNK_BYTES` of float32 logits).
    Returns logps [N, C] float32 (differentiable in hidden, weight, bias) and entropy [N, C] float32 (no gradient)
    or None.
    """
    N, C, H = hidden.shape
    V = weight.size(0)
    if targets.shape != (N, C):
        raise ValueError(f"targets must be [N, C]={(N, C)}, got {tuple(targets.shape)}")
    chunk = chunk_tokens or default_chunk_tokens(V)
    logps, entropy = _SelectiveLogps.apply(hidden.reshape(N * C, H), weight, bias, targets.reshape(N * C).long(),
                                           float(temperature), int(chunk), bool(with_entropy),
                                           matmul_dtype(hidden))  # [N*C], [N*C] or [0]
    return logps.view(N, C), (entropy.view(N, C) if with_entropy else None)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float,
                  out: torch.Tensor) -> torch.Tensor:
    """One chunk's logits at the temperature, written into `out` [n, V] (float32; float64 for float64 inputs).

    The matmul runs in w's dtype (h and b are already in it), as `lm_head` would; a bf16 result is upcast into
    `out`. F.linear is addmm / mm, so writing straight into `out` changes no number; neither does skipping a
    division by 1.
    """
    if w.dtype == out.dtype:
        if b is None:
            torch.mm(h, w.t(), out=out)  # [n, V]
        else:
            torch.addmm(b, h, w.t(), out=out)  # [n, V]
    else:
        out.copy_(F.linear(h, w, b))  # [n, V] bf16 (or fp16) matmul, then upcast
    if temperature > 0 and temperature != 1.0:
        out.div_(temperature)  # the distribution the tokens were sampled from
    return out


class _SelectiveLogps(torch.autograd.Function):
    """Flattened tokens: hidden [T, H], weight [V, H], bias [V] | None, targets [T] -> logps [T], entropy [T].

    Every chunk works in the same one or two [chunk, V] buffers: fresh vocabulary-sized tensors per chunk would
    cost page faults on each (CPU), and the buffers are what bounds the memory anyway.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy, mm_dtype):
        T, V = hidden.size(0), weight.size(0)
        acc = torch.promote_types(mm_dtype, torch.float32)  # float32 as `.float()` (float64 stays, for gradcheck)
        logps = hidden.new_empty(T, dtype=acc)  # [T]
        lse = hidden.new_empty(T, dtype=acc)  # [T] logsumexp of each token's tempered logits
        entropy = hidden.new_empty(T if with_entropy else 0, dtype=acc)  # [T] or [0]
        z_buf = hidden.new_empty(min(chunk, T), V, dtype=acc)  # [chunk, V] the chunk's logits
        logp_buf = torch.empty_like(z_buf)  # [chunk, V] their log-softmax
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit from here on
            w = weight.to(mm_dtype)  # [V, H] a copy only under autocast (as autocast's own cast)
            b = None if bias is None else bias.to(mm_dtype)  # [V]
            for s in range(0, T, chunk):
                e = min(s + chunk, T)
                t = targets[s:e, None]  # [n, 1]
                z = _chunk_logits(hidden[s:e].to(mm_dtype), w, b, temperature, z_buf[: e - s])  # [n, V]
                logp = torch.log_softmax(z, -1, out=logp_buf[: e - s])  # [n, V] one fused pass a row
                logps[s:e] = logp.gather(1, t).squeeze(1)  # [n] log p(target)
                lse[s:e] = z.gather(1, t).squeeze(1) - logps[s:e]  # [n] z_t - log p_t
                if with_entropy:
                    p = torch.exp(logp, out=z)  # [n, V] the logits are no longer needed
                    entropy[s:e] = -torch.bmm(p[:, None, :], logp[:, :, None]).view(-1)  # [n] -sum p log p
        del z_buf, logp_buf
        # References to the inputs plus 4 bytes a token: nothing vocabulary-sized outlives the forward.
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk, ctx.mm_dtype = temperature, chunk, mm_dtype
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, chunk, mm_dtype = ctx.temperature, ctx.chunk, ctx.mm_dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        T, V = hidden.size(0), weight.size(0)
        acc = lse.dtype  # float32 (float64 for float64 inputs)
        # through z = logits / temperature: every logit gradient is divided by it, so divide the T factors once
        grad = grad_logps.to(acc) / (temperature if temperature > 0 else 1.0)  # [T]
        grad_h = torch.empty_like(hidden) if need_h else None  # [T, H]
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # [V, H]
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None  # [V]
        z_buf = hidden.new_empty(min(chunk, T), V, dtype=acc)  # [chunk, V]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(mm_dtype)  # [V, H]
            b = None if bias is None else bias.to(mm_dtype)  # [V]
            for s in range(0, T, chunk):
                e = min(s + chunk, T)
                g = grad[s:e, None]  # [n, 1]
                h = hidden[s:e].to(mm_dtype)  # [n, H]
                # d logp(t) / d z = onehot(t) - softmax(z): recompute z, rebuild softmax from the saved logsumexp.
                dz = _chunk_logits(h, w, b, temperature, z_buf[: e - s]).sub_(lse[s:e, None]).exp_()  # [n, V]
                dz.mul_(-g).scatter_add_(1, targets[s:e, None], g)  # [n, V] g * (onehot - softmax)
                dz = dz.to(mm_dtype)  # [n, V] the gradient of the matmul's output, in its dtype
                if need_h:
                    grad_h[s:e] = dz @ w  # [n, H] (cast to the hidden's dtype by the copy)
                if need_w:
                    if mm_dtype == acc:
                        grad_w.addmm_(dz.t(), h)  # [V, H] accumulated in place
                    else:  # a block of the vocabulary at a time: no [V, H] product and fp32 copy of it per chunk
                        rows = max(1, WGRAD_BLOCK_BYTES // (weight.size(1) * 4))
                        for v in range(0, V, rows):
                            grad_w[v : v + rows] += (dz[:, v : v + rows].t() @ h).to(acc)  # [rows, H]
                if need_b:
                    grad_b += dz.to(acc).sum(0)  # [V]
        del z_buf
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def plain_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: log-probs from [N, C, V] float32 logits (what `token_logps` does from the hidden states on)."""
    return logps_from_logits(F.linear(hidden, weight, bias), targets, temperature, with_entropy)


def logps_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at `targets` [N, C] (and the entropy, no gradient) from [N, C, V] logits."""
    logits = logits.float()  # [N, C, V]
    if temperature > 0 and temperature != 1.0:  # at 1.0 no second [N, C, V] copy
        logits = logits / temperature  # the distribution the tokens were sampled from
    logp_all = torch.log_softmax(logits, -1)  # [N, C, V]
    logps = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # [N, C]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, C]
    return logps, entropy
