"""selective_logps gives the plain path's log-probs, entropy and gradients without keeping [N, C, V] logits."""

import pytest
import torch

from grpo.kernels.logprobs import default_chunk_tokens, plain_logps, selective_logps


def _inputs(N=3, C=5, H=16, V=50, bias=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, C, H, generator=g).to(dtype).requires_grad_()  # [N, C, H]
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_()  # [V, H]
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None  # [V]
    targets = torch.randint(0, V, (N, C), generator=g)  # [N, C]
    upstream = torch.randn(N, C, generator=g) * (torch.rand(N, C, generator=g) > 0.3)  # [N, C] some tokens masked
    return hidden, weight, b, targets, upstream


def _grads(fn, hidden, weight, bias, targets, upstream, temperature, **kw):
    """(logps, entropy, grads of hidden/weight/bias) for sum(logps * upstream)."""
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    logps, entropy = fn(hidden, weight, bias, targets, temperature, with_entropy=True, **kw)
    (logps * upstream).sum().backward()
    grads = [None if t is None or t.grad is None else t.grad.clone() for t in (hidden, weight, bias)]
    return logps.detach(), entropy, grads


def _close(a, b, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, None])  # one token a chunk, uneven chunks, all in one
def test_values_entropy_and_gradients_match_the_plain_path(temperature, bias, chunk):
    hidden, weight, b, targets, upstream = _inputs(bias=bias)
    want = _grads(plain_logps, hidden, weight, b, targets, upstream, temperature)
    got = _grads(selective_logps, hidden, weight, b, targets, upstream, temperature, chunk_tokens=chunk)
    assert got[0].dtype == torch.float32 and got[0].shape == (3, 5)
    _close(got[0], want[0])  # logps
    _close(got[1], want[1])  # entropy
    assert not got[1].requires_grad
    for g, w in zip(got[2], want[2]):
        if w is None:
            assert g is None
        else:
            _close(g, w)


def test_masked_tokens_get_no_gradient():
    hidden, weight, b, targets, upstream = _inputs()
    upstream[1] = 0  # a whole row masked
    _, _, (gh, _, _) = _grads(selective_logps, hidden, weight, b, targets, upstream, 0.7, chunk_tokens=3)
    assert (gh[1] == 0).all() and (gh[0] != 0).any()


def test_tied_embedding_gets_both_gradients():
    """The head's weight is the embedding's: its gradient is the sum of both uses, as with the plain head."""
    torch.manual_seed(0)
    V, H, N, C = 40, 8, 2, 6
    emb = torch.nn.Embedding(V, H)
    mix = torch.nn.Linear(H, H)
    ids = torch.randint(0, V, (N, C + 1))
    targets, upstream = ids[:, 1:], torch.rand(N, C)

    def run(fn, **kw):
        emb.zero_grad(), mix.zero_grad()
        hidden = torch.tanh(mix(emb(ids[:, :-1])))  # [N, C, H] a stand-in for the decoder
        logps, _ = fn(hidden, emb.weight, None, targets, 0.7, **kw)
        (logps * upstream).sum().backward()
        return logps.detach(), emb.weight.grad.clone(), mix.weight.grad.clone()

    want, got = run(plain_logps), run(selective_logps, chunk_tokens=5)
    for g, w in zip(got, want):
        _close(g, w)


def test_frozen_head_or_frozen_hidden():
    hidden, weight, b, targets, upstream = _inputs()
    weight.requires_grad_(False), b.requires_grad_(False)
    want = _grads(plain_logps, hidden, weight, b, targets, upstream, 1.0)
    got = _grads(selective_logps, hidden, weight, b, targets, upstream, 1.0, chunk_tokens=4)
    _close(got[2][0], want[2][0])
    assert got[2][1] is None and got[2][2] is None
    hidden = hidden.detach()
    weight.requires_grad_()
    want = _grads(plain_logps, hidden, weight, None, targets, upstream, 1.0)
    got = _grads(selective_logps, hidden, weight, None, targets, upstream, 1.0, chunk_tokens=4)
    _close(got[2][1], want[2][1])


def test_without_grad_and_without_entropy():
    hidden, weight, b, targets, _ = _inputs()
    with torch.no_grad():
        logps, entropy = selective_logps(hidden, weight, b, targets, 0.7, chunk_tokens=2)
        want, _ = plain_logps(hidden, weight, b, targets, 0.7)
    assert entropy is None and not logps.requires_grad
    _close(logps, want)


def test_full_qwen_vocabulary():
    """V = 151,936 (Qwen2's), a small batch: the default chunk and uneven chunk boundaries."""
    hidden, weight, b, targets, upstream = _inputs(N=2, C=8, H=64, V=151_936, bias=False)
    want = _grads(plain_logps, hidden, weight, b, targets, upstream, 0.7)
    for chunk in (None, 5):
        got = _grads(selective_logps, hidden, weight, b, targets, upstream, 0.7, chunk_tokens=chunk)
        _close(got[0], want[0])
        _close(got[1], want[1], rtol=1e-5, atol=1e-4)  # entropy ~ 12 nats summed over 151,936 terms
        _close(got[2][0], want[2][0])
        _close(got[2][1], want[2][1])


def test_gradcheck_float64():
    hidden, weight, b, targets, _ = _inputs(N=2, C=3, H=4, V=7, dtype=torch.float64)
    for temperature, chunk in ((0.7, 2), (0.0, 4), (1.0, 5)):

        def logps(h, w, bb, temperature=temperature, chunk=chunk):
            return selective_logps(h, w, bb, targets, temperature, chunk_tokens=chunk)[0]

        assert torch.autograd.gradcheck(logps, (hidden, weight, b))


def _bf16_tol(a, b):
    _close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_bfloat16_weights_and_hidden():
    """A model loaded in bf16: the logits come from a bf16 matmul, then float32, like `lm_head(hidden).float()`."""
    hidden, weight, b, targets, upstream = _inputs(N=2, C=4, H=32, V=1000, dtype=torch.bfloat16)
    want = _grads(plain_logps, hidden, weight, b, targets, upstream, 0.7)
    got = _grads(selective_logps, hidden, weight, b, targets, upstream, 0.7, chunk_tokens=3)
    assert got[0].dtype == torch.float32 and got[2][0].dtype == torch.bfloat16 and got[2][1].dtype == torch.bfloat16
    _close(got[0], want[0])  # same bf16 logits, same float32 softmax
    _close(got[1], want[1])
    for g, w in zip(got[2], want[2]):
        _bf16_tol(g, w)


def test_under_autocast_like_the_gpu_training_step():
    """Float32 weights and hidden under bf16 autocast: the head's matmul runs in bf16 as `lm_head` would."""
    hidden, weight, b, targets, upstream = _inputs(N=2, C=4, H=32, V=1000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _grads(plain_logps, hidden, weight, b, targets, upstream, 0.7)
        got = _grads(selective_logps, hidden, weight, b, targets, upstream, 0.7, chunk_tokens=3)
    exact = _grads(plain_logps, hidden, weight, b, targets, upstream, 0.7)
    assert (got[0] - exact[0]).abs().max() > 1e-4  # it did run in bf16
    _close(got[0], want[0])
    assert all(g.dtype == torch.float32 for g in got[2])
    for g, w in zip(got[2], want[2]):
        _bf16_tol(g, w)


def _saved_bytes(fn, *args, **kw) -> tuple[int, int]:
    """Bytes autograd keeps for the backward: (all distinct storages, those that are not the inputs')."""
    inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kw)
    return sum(seen.values()), sum(n for p, n in seen.items() if p not in inputs)


def test_keeps_no_vocabulary_sized_tensor_for_the_backward():
    N, C, H, V = 4, 64, 32, 4096
    hidden, weight, b, targets, _ = _inputs(N=N, C=C, H=H, V=V)
    logits_bytes = N * C * V * 4  # 4 MiB
    _, plain_new = _saved_bytes(plain_logps, hidden, weight, b, targets, 0.7, with_entropy=True)
    sel_all, sel_new = _saved_bytes(selective_logps, hidden, weight, b, targets, 0.7, with_entropy=True)
    assert plain_new >= logits_bytes  # the log-softmax output, at least
    assert sel_new == N * C * 4  # the logsumexp (float32); targets are a view of the input's
    assert sel_all < logits_bytes / 4  # the rest are references to the inputs (hidden, weight, bias)


def test_bf16_weight_gradient_is_accumulated_a_block_at_a_time(monkeypatch):
    """Under bf16 autocast the head's fp32 weight gradient is summed from bf16 products: a block of the vocabulary at
    a time makes no [V, H] product (bf16) nor its fp32 copy, and gives the whole product's gradient bit for bit."""
    from benchmarks.bytes_alive import BytesAlive
    from grpo.kernels import logprobs

    H, V = 64, 8192
    hidden, weight, _, targets, upstream = _inputs(N=2, C=16, H=H, V=V)
    peaks, grads = {}, {}
    for name, block in (("blocked", 256 * H * 4), ("whole", V * H * 4)):  # 256 rows a block, or all V
        monkeypatch.setattr(logprobs, "WGRAD_BLOCK_BYTES", block)
        w = weight.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logps, _ = selective_logps(hidden.detach(), w, None, targets, 1.0, chunk_tokens=8)
        with BytesAlive() as alive:
            (logps * upstream).sum().backward()
        peaks[name], grads[name] = alive.peak, w.grad
    assert torch.equal(grads["blocked"], grads["whole"])
    product = V * H * (2 + 4)  # the whole [V, H] product in bf16 and its fp32 copy: 3 MiB
    assert peaks["whole"] - peaks["blocked"] >= 0.9 * product  # less a block's and a few small tensors' bytes


def test_default_chunk():
    assert default_chunk_tokens(151_936) == 220
    assert default_chunk_tokens(151_936, 64 * 2**20) == 110
    assert default_chunk_tokens(10**12) == 1


def test_bad_targets_shape():
    hidden, weight, b, targets, _ = _inputs()
    with pytest.raises(ValueError, match="targets"):
        selective_logps(hidden, weight, b, targets[:, :-1], 1.0)
