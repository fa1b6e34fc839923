"""token_logps through the chunked head (grpo.kernels.logprobs) gives the plain path's numbers and gradients on
real tiny Qwen2 models (tied heads, shared prompts, a 151,936-entry vocabulary), and falls back where it must."""

import pytest
import torch
import transformers

import grpo.training.logprobs as logprobs
from grpo.training.logprobs import selective_head, token_logps

PLAIN = 2**62  # plain_max_bytes that keeps every batch on the plain path
CHUNKED = 0  # ... and one that sends every batch through the chunked head


def _model(vocab=1000, hidden=64, layers=2, **extra):
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0, **extra)
    return transformers.Qwen2ForCausalLM(cfg)


def _batch(groups=3, G=4, P=6, C=10, vocab=1000):
    """Rows in groups sharing a left-padded prompt, then right-padded completions."""
    torch.manual_seed(1)
    lengths = torch.tensor([2, 6, 4, 5][:groups])
    prompt = torch.randint(1, vocab, (groups, P))
    pmask = (torch.arange(P) >= P - lengths[:, None]).long()  # [groups, P] left padding
    prompt, pmask = (prompt * pmask).repeat_interleave(G, 0), pmask.repeat_interleave(G, 0)
    comp = torch.randint(1, vocab, (groups * G, C))
    cmask = (torch.arange(C) < torch.randint(1, C + 1, (groups * G, 1))).long()  # ends at random
    return torch.cat([prompt, comp * cmask], 1), torch.cat([pmask, cmask], 1), C


def _run(model, ids, mask, C, temperature, **kw):
    """(logps, entropy, every parameter's gradient) for a weighted sum of the completion log-probs."""
    model.zero_grad()
    logps, entropy = token_logps(model, ids, mask, C, temperature, with_entropy=True, **kw)
    cm = mask[:, -C:].float()
    (logps * cm * torch.linspace(-1, 1, C)).sum().backward()
    return logps.detach() * cm, entropy * cm, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
    for n, w in want[2].items():  # float32 sums in another order: ~1e-5 of the tensor's scale
        torch.testing.assert_close(got[2][n], w, rtol=1e-4, atol=3e-5 * w.abs().max().item(), msg=n)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_matches_the_plain_path_with_shared_prompts(train, temperature):
    model = _model().train(train)
    assert selective_head(model) is model.lm_head
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one weight, two gradients
    ids, mask, C = _batch()
    calls = []
    forward = model.model.forward
    model.model.forward = lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k)
    got = _run(model, ids, mask, C, temperature, plain_max_bytes=CHUNKED, chunk_tokens=7)
    assert calls == [(3, 6), (12, C - 1)]  # the prompt-sharing path: 3 prompts once, then the completions
    calls.clear()
    want = _run(model, ids, mask, C, temperature, plain_max_bytes=PLAIN)
    assert calls == [(3, 6), (12, C - 1)]
    del model.model.forward
    _assert_same(got, want)


def test_chunked_head_without_shared_prompts_is_one_pass():
    model = _model().train()
    ids, mask, C = _batch(G=1)
    calls = []
    forward = model.model.forward
    model.model.forward = lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k)
    got = _run(model, ids, mask, C, 1.0, plain_max_bytes=CHUNKED, chunk_tokens=4)
    del model.model.forward
    assert calls == [ids.shape]
    _assert_same(got, _run(model, ids, mask, C, 1.0, plain_max_bytes=PLAIN))


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


@pytest.mark.parametrize("G", [1, 2])  # G=1: no prompt to share (one plain pass); G=2: the shared prompt pass
def test_under_bf16_autocast(G):
    """bf16 autocast (the GPU training step's mode) on CPU.

    Without a shared prompt the gradients are bit for bit the plain path's. With one they differ by bf16 rounding
    only: the plain path sums the G rows' logit gradients in bf16 before the head's backward, the chunked path
    sums their hidden-state gradients in float32 (and its head-weight gradient, chunk by chunk, in float32): no
    further apart than the plain bf16 path is from its float32 one.
    """
    model = _model().train()
    ids, mask, C = _batch(groups=2, G=G, C=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(model, ids, mask, C, 0.7, plain_max_bytes=CHUNKED, chunk_tokens=1000 if G == 1 else 5)
        want = _run(model, ids, mask, C, 0.7, plain_max_bytes=PLAIN)
    exact = _run(model, ids, mask, C, 0.7, plain_max_bytes=PLAIN)  # float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)  # same bf16 logits, float32 softmax
    for n in want[2]:
        if G == 1:
            torch.testing.assert_close(got[2][n], want[2][n], rtol=0, atol=0, msg=n)
        else:
            assert _rel(got[2][n], want[2][n]) < 3e-2, n
            assert _rel(got[2][n], exact[2][n]) < 3e-2, n


def test_qwen_vocabulary_on_cpu():
    """V = 151,936 (Qwen2.5's) through token_logps: the default chunk (one chunk here) and 7-token chunks."""
    V = 151_936
    model = _model(vocab=V, hidden=32, layers=1).train()
    ids, mask, C = _batch(groups=2, G=3, C=8, vocab=V)
    want = _run(model, ids, mask, C, 0.7, plain_max_bytes=PLAIN)
    for chunk in (None, 7):
        _assert_same(_run(model, ids, mask, C, 0.7, plain_max_bytes=CHUNKED, chunk_tokens=chunk), want)


def _largest_saved(fn) -> int:
    """Bytes of the largest tensor autograd keeps for the backward that is not a parameter."""
    sizes = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes)


def test_default_threshold_chooses_the_path_by_the_size_of_the_logits():
    """Logits over PLAIN_LOGITS_MAX_BYTES go through the chunked head: nothing vocabulary-sized is kept for the
    backward (the plain path keeps at least the [N, C, V] log-softmax). Small ones take the plain path."""
    V = 151_936
    model = _model(vocab=V, hidden=16, layers=1).train()
    ids, mask, C = _batch(groups=2, G=4, C=64, vocab=V)  # 512 tokens: 297 MiB of float32 logits
    full = ids.size(0) * C * V * 4
    assert full > logprobs.PLAIN_LOGITS_MAX_BYTES
    chunked = _largest_saved(lambda: token_logps(model, ids, mask, C, 1.0, with_entropy=True))
    plain = _largest_saved(lambda: token_logps(model, ids, mask, C, 1.0, with_entropy=True, plain_max_bytes=PLAIN))
    assert plain >= full and chunked < full / 100
    small = _largest_saved(lambda: token_logps(model, ids[:1], mask[:1], C, 1.0))  # 37 MiB of logits
    assert small >= C * V * 4  # the plain path


def test_heads_it_must_not_take():
    assert selective_head(torch.nn.Linear(2, 2)) is None  # not a PreTrainedModel (a DDP wrapper, say)
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0))
    assert selective_head(gemma) is None  # tanh soft-capping of the logits
    patched = _model()
    patched.forward = patched.forward  # someone's patch of the forward
    assert selective_head(patched) is None


def test_a_hooked_head_falls_back_to_the_plain_path():
    """A hook that changes the logits (here: a banned token) must be honoured, so the chunked head is not used."""
    model = _model()
    ids, mask, C = _batch(groups=1, G=2, C=4)
    targets = ids[:, -C:]

    def ban(module, args, out):
        return out.index_fill(-1, targets[0, :1], -1e4)  # the first row's first token: log p ~ -1e4

    model.lm_head.register_forward_hook(ban)
    assert selective_head(model) is None
    with torch.no_grad():
        logps, _ = token_logps(model, ids, mask, C, 1.0, plain_max_bytes=CHUNKED)
    assert logps[0, 0] < -1000
