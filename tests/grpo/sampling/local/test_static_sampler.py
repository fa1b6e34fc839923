"""The static-cache sampler against the model's own forward and a naive sampling loop, on tiny random decoders."""

import copy

import pytest
import scipy.stats
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bytes_alive import BytesAlive
from grpo.configs.sampling import SamplingConfig
from grpo.sampling.draws import draw_streams
from grpo.sampling.local import static_sampler
from grpo.sampling.local.decode_step import read_weights
from grpo.sampling.local.static_sampler import StaticSampler, prompt_bucket, unsupported_reason
from tiny_decoders import (EOS, KINDS, PAD, allowed_tokens, forward_logits, fp32_gap, left_padded, make_model,
                           recorded_logits, reference_loop)

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)


@pytest.mark.parametrize("full_cache", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_step_logits_equal_the_models_forward(kind, full_cache, monkeypatch):
    model = make_model(kind, head_scale=4.0)  # logits of a few units
    ids, mask = left_padded([5, 11, 3, 8], repeat=2)
    seen = recorded_logits(monkeypatch)
    sampler = StaticSampler(model, full_cache_attention=full_cache, buckets=full_cache)  # as captured, and eager
    out = sampler.sample(ids, mask, SamplingConfig(max_new_tokens=12), [], PAD)  # no end token: 12 steps
    assert out.completion_ids.shape == (8, 12) and len(seen) == 12
    want = forward_logits(model, torch.cat([ids, out.completion_ids], 1),
                          torch.cat([mask, out.completion_mask], 1))[:, ids.size(1) - 1 : -1]  # [B, 12, V]
    got = torch.stack(seen, 1)  # [B, 12, V]: the prefill's, then each step's
    assert got.abs().max() > 1 and fp32_gap(got, want) <= 1e-5


@pytest.mark.parametrize("sampling", [SamplingConfig(max_new_tokens=20, temperature=0.8),
                                      SamplingConfig(max_new_tokens=20, temperature=1.2, top_k=10, top_p=0.9),
                                      SamplingConfig(max_new_tokens=20, temperature=0)])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_the_same_tokens_as_a_reference_loop_with_the_same_streams(kind, sampling):
    model = make_model(kind)
    ids, mask = left_padded([5, 11, 3], repeat=3)
    u = draw_streams(ids.size(0), generator=torch.Generator().manual_seed(2))  # [B] the rows' random streams
    got = StaticSampler(model).sample(ids, mask, sampling, EOS, PAD, streams=u)
    want_ids, want_mask, want_lp, want_truncated = reference_loop(model, ids, mask, sampling, u)
    assert torch.equal(got.completion_ids, want_ids) and torch.equal(got.completion_mask, want_mask)
    assert torch.equal(got.truncated, want_truncated)
    assert torch.allclose(got.logprobs, want_lp, atol=1e-5)


@pytest.mark.parametrize("sampler", ["static", "loop"])
def test_top_k_and_top_p_draw_only_inside_the_cut(sampler):
    # The reference loop above chooses with the engine's own rule, so it cannot see a cut the engine leaves out.
    # Here every sampled token must lie in the top-k / nucleus set of the model's own forward logits at its
    # position, that set computed apart from the engine (`allowed_tokens`, float64); and the cut matters: outside
    # it lies enough mass that a sampler drawing from the whole distribution would land there.
    from grpo.sampling.local.backend import sample_batch

    model = make_model(head_scale=4.0)  # spread: the cut drops a real share of the mass
    ids, mask = left_padded([5, 11, 3, 8], repeat=4)
    s = SamplingConfig(max_new_tokens=16, temperature=1.2, top_k=10, top_p=0.8)
    torch.manual_seed(12)
    if sampler == "static":
        out = StaticSampler(model).sample(ids, mask, s, EOS, PAD)
        got_ids, got_mask = out.completion_ids, out.completion_mask
    else:
        got_ids, got_mask, _, _ = sample_batch(model, ids, mask, s, EOS, PAD)  # the decode loop's `_pick`
    logits = forward_logits(model, torch.cat([ids, got_ids], 1),
                            torch.cat([mask, got_mask], 1))[:, ids.size(1) - 1 : -1]  # [B, C, V]
    allowed = allowed_tokens(logits, s.temperature, s.top_k, s.top_p)  # [B, C, V]
    on = got_mask.bool()
    inside = allowed.gather(-1, got_ids[..., None]).squeeze(-1)  # [B, C]
    assert inside[on].all(), f"{int((~inside & on).sum())} of {int(on.sum())} tokens outside the cut"
    outside = ((logits.double() / s.temperature).softmax(-1) * ~allowed).sum(-1)[on]  # [N] the mass cut off
    assert on.sum() > 50 and outside.mean() > 0.1
    assert (1 - outside).prod() < 1e-6  # the odds that uncut draws all stayed inside


def test_rows_that_end_stop_changing_and_are_padded():
    model = make_model(head_scale=1.0)  # near-uniform: an end token every ~8 tokens
    ids, mask = left_padded([5, 11, 3, 7], repeat=4)
    u = draw_streams(16, generator=torch.Generator().manual_seed(3))
    out = StaticSampler(model).sample(ids, mask, SamplingConfig(max_new_tokens=40), EOS, PAD, streams=u)
    lengths = out.completion_mask.sum(1)  # [B]
    assert lengths.min() < lengths.max() < 40  # rows end at different steps, all before the budget
    assert out.completion_ids.size(1) == lengths.max()  # no column past the last row's end
    for row, n in enumerate(lengths.tolist()):
        assert out.completion_mask[row, :n].all() and not out.completion_mask[row, n:].any()
        assert out.completion_ids[row, n - 1] in EOS and (out.completion_ids[row, n:] == PAD).all()
        assert (out.logprobs[row, n:] == 0).all() and (out.logprobs[row, :n] < 0).all()
    assert not out.truncated.any()


def test_one_new_token():
    model = make_model()
    ids, mask = left_padded([5, 11])
    s = SamplingConfig(max_new_tokens=1)
    u = draw_streams(2, generator=torch.Generator().manual_seed(4))
    out = StaticSampler(model).sample(ids, mask, s, EOS, PAD, streams=u)
    want = reference_loop(model, ids, mask, s, u)
    assert out.completion_ids.shape == (2, 1) and torch.equal(out.completion_ids, want[0])
    assert torch.equal(out.truncated, want[3])


def test_prompt_buckets():
    assert [prompt_bucket(n) for n in (1, 32, 33, 64, 200, 256, 257, 300, 513)] == [32, 32, 64, 64, 224, 256, 384,
                                                                                     384, 640]


def test_prompts_in_several_buckets_share_captures_per_bucket():
    model = make_model()
    sampler = StaticSampler(model, buckets=True, full_cache_attention=True)  # as on CUDA, without the graphs
    s = SamplingConfig(max_new_tokens=6, temperature=0.9)
    for lengths in ([5, 30], [40, 33], [70, 2, 65]):  # buckets 32, 64 and 96
        ids, mask = left_padded(lengths, repeat=2)
        u = draw_streams(ids.size(0), generator=torch.Generator().manual_seed(len(lengths)))
        got = sampler.sample(ids, mask, s, EOS, PAD, streams=u)
        want = reference_loop(model, ids, mask, s, u)
        assert torch.equal(got.completion_ids, want[0]) and torch.equal(got.completion_mask, want[1])


def test_an_optimizer_step_is_seen_after_sync_weights():
    model = make_model()
    ids, mask = left_padded([5, 11, 3], repeat=2)
    s = SamplingConfig(max_new_tokens=8, temperature=0)
    sampler = StaticSampler(model, dtype=torch.bfloat16)  # a bf16 copy, as under bf16 autocast
    before = sampler.sample(ids, mask, s, [], PAD)
    copy = sampler._sampling_model()
    assert copy.lm_head.weight.dtype == torch.bfloat16 and copy.model.rotary_emb.inv_freq.dtype == torch.float32
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with torch.no_grad():
        logits = forward_logits(model, ids, mask)[:, -1]  # [B, V]
    loss = model(input_ids=ids, attention_mask=mask).logits[:, -1].logsumexp(-1).sum() - model(
        input_ids=ids, attention_mask=mask).logits[:, -1, logits.argmin(-1)].diagonal().sum()
    loss.backward()  # push each row toward its least likely token
    opt.step()
    sampler.sync_weights(model)
    after = sampler.sample(ids, mask, s, [], PAD)
    fresh = StaticSampler(model, dtype=torch.bfloat16).sample(ids, mask, s, [], PAD)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert torch.equal(after.completion_ids, fresh.completion_ids)
    assert torch.equal(after.logprobs, fresh.logprobs)


# Pearson's chi-square over 16 tokens (15 degrees of freedom): its 0.1% tail (37.70), so a sampler that follows the
# distribution passes with the test's seed (and almost any other), and one that does not fails
CHI2_TAIL = scipy.stats.chi2.ppf(0.999, 15)


def test_sampled_frequencies_follow_the_softmax():
    model = make_model(vocab=16)
    ids, mask = left_padded([6], seed=4, vocab=16)
    n = 4000
    ids, mask = ids.expand(n, -1), mask.expand(n, -1)
    torch.manual_seed(5)
    s = SamplingConfig(max_new_tokens=2, temperature=1.5)
    out = StaticSampler(model).sample(ids, mask, s, [], PAD)
    first = forward_logits(model, ids[:1], mask[:1])[0, -1].div(1.5).softmax(-1)  # [16]
    counts = torch.bincount(out.completion_ids[:, 0], minlength=16).double()
    chi2 = ((counts - n * first) ** 2 / (n * first)).sum()
    assert chi2 < CHI2_TAIL
    # the second token, after the most frequent first one: the decode step's own distribution
    tok = int(counts.argmax())
    rows = out.completion_ids[:, 0] == tok
    second = forward_logits(model, torch.cat([ids[:1], torch.tensor([[tok]])], 1),
                            torch.cat([mask[:1], torch.ones(1, 1, dtype=torch.long)], 1))[0, -1].div(1.5).softmax(-1)
    m = int(rows.sum())
    counts = torch.bincount(out.completion_ids[rows, 1], minlength=16).double()
    assert ((counts - m * second) ** 2 / (m * second)).sum() < CHI2_TAIL
    # and the check has teeth: the same counts against a flat distribution fail it
    assert ((counts - m / 16) ** 2 / (m / 16)).sum() > CHI2_TAIL


class _Widest64(TorchDispatchMode):
    """The most elements of any float64 tensor an op makes within the block."""

    most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("V", [151_936, 3000, 1024, 96])
def test_two_level_inverse_cdf_picks_what_a_full_float64_cumsum_picks(V):
    # Qwen's vocabulary (148 whole blocks and a short one), a short last block, one whole block, less than one;
    # peaky rows with a long tail, zeroed entries (top-k style) and whole zero blocks at the end
    g = torch.Generator().manual_seed(11)
    B = 64
    probs = (torch.randn(B, V, generator=g) * 4).softmax(-1)  # [B, V] float32
    probs[torch.rand(B, V, generator=g) < 0.3] = 0.0
    probs[B // 2 :, V - V // 3 :] = 0.0
    u = torch.rand(B, dtype=torch.float64, generator=g)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1e-300], dtype=torch.float64)  # the ends of [0, 1)
    with _Widest64() as widest:
        got = static_sampler.inverse_cdf(probs, u)  # [B]
    cdf = probs.double().cumsum(-1)  # [B, V] the one-level reference
    want = torch.searchsorted(cdf, (1 - u)[:, None] * cdf[:, -1:]).squeeze(-1)  # [B]
    assert torch.equal(got, want)
    assert (probs.gather(1, got[:, None]) > 0).all()
    assert widest.most <= B * max(min(V, static_sampler.CDF_BLOCK), -(-V // static_sampler.CDF_BLOCK))


@pytest.mark.parametrize("captured", [False, True])
def test_a_memory_budget_admits_rows_as_their_pages_fit_with_the_same_tokens(captured):
    model = make_model()
    ids, mask = left_padded([5, 11, 3, 9], repeat=2)
    s = SamplingConfig(max_new_tokens=16, temperature=1.0)
    u = draw_streams(8, generator=torch.Generator().manual_seed(6))
    kw = dict(keep_captures=True, full_cache_attention=True) if captured else {}
    whole = StaticSampler(model, buckets=True, **kw).sample(ids, mask, s, EOS, PAD, streams=u)
    # a row's pages: its prompt's (up to 32 positions: 2 of 16) and its 16 tokens' (1), and one a resumed row may
    # need more: 4 pages of 2 layers x (K and V) x 2 KV heads x 16 positions x 16 dims x 4 bytes = 8,192 bytes each
    page = 2 * 2 * 2 * 16 * 16 * 4
    tight = StaticSampler(model, memory_budget=9 * page, buckets=True, **kw)  # room for two rows at a time
    parts = tight.sample(ids, mask, s, EOS, PAD, streams=u)
    assert torch.equal(whole.completion_ids, parts.completion_ids)
    assert torch.equal(whole.completion_mask, parts.completion_mask) and torch.equal(whole.truncated, parts.truncated)
    assert torch.allclose(whole.logprobs, parts.logprobs, atol=1e-5)  # fewer rows a step may round a matmul apart
    assert tight.counts.pages_high_water <= 8  # page 0 is never handed out
    with pytest.raises(ValueError, match="holds no row"):
        StaticSampler(model, memory_budget=4 * page - 1, buckets=True, **kw).sample(ids, mask, s, EOS, PAD)


def test_logprobs_only_when_asked():
    model = make_model()
    ids, mask = left_padded([5, 11])
    out = StaticSampler(model).sample(ids, mask, SamplingConfig(max_new_tokens=4), EOS, PAD, return_logprobs=False)
    assert out.logprobs is None and out.completion_ids.size(0) == 2


def test_unknown_or_altered_decoders_are_refused_with_a_reason():
    assert unsupported_reason(make_model()) is None
    gelu = make_model()
    gelu.config.hidden_act = "gelu"
    assert "silu" in unsupported_reason(gelu)
    hooked = make_model()
    hooked.lm_head.register_forward_hook(lambda m, a, out: out)
    assert "hooks" in unsupported_reason(hooked)
    windowed = make_model("mistral")
    windowed.config.sliding_window = 16
    assert unsupported_reason(windowed, 8) is None and "window" in unsupported_reason(windowed, 40)
    from transformers import GPT2Config, GPT2LMHeadModel
    assert "GPT2LMHeadModel" in unsupported_reason(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)))


def test_a_seed_samples_what_the_decode_loop_samples():
    from grpo.sampling.local.backend import sample_batch

    model = make_model()
    ids, mask = left_padded([5, 11, 3], repeat=3)
    s = SamplingConfig(max_new_tokens=16, temperature=0.9)
    torch.manual_seed(8)
    loop = sample_batch(model, ids, mask, s, EOS, PAD)  # the lean decode loop, each row's draw a step
    torch.manual_seed(8)
    static = StaticSampler(model).sample(ids, mask, s, EOS, PAD)
    assert torch.equal(loop[0], static.completion_ids) and torch.equal(loop[1], static.completion_mask)
    assert torch.allclose(loop[2], static.logprobs, atol=1e-5)


@pytest.mark.parametrize("sampler", ["static", "loop"])
def test_sampled_logprobs_are_the_trainers_under_temperature_and_top_p(sampler):
    # An importance weight pi_train / pi_sampler (TIS, decoupled PPO's pi_prox / pi_behave) must be 1 where no
    # weight changed. The trainer's policy is the tempered full distribution (token_logps at the temperature); the
    # sampler draws from its top-p cut, renormalised, but records the token's log-prob before the cut. Recording
    # the cut distribution's instead (TRL issue #7120) put log(kept mass) between the two on every token.
    from grpo.sampling.local.backend import sample_batch
    from grpo.training.logprobs import token_logps

    model = make_model(head_scale=4.0)  # spread enough that top_p 0.8 cuts a real share of the mass
    ids, mask = left_padded([5, 11, 3], repeat=3)
    s = SamplingConfig(max_new_tokens=16, temperature=0.7, top_p=0.8)
    torch.manual_seed(11)
    if sampler == "static":
        out = StaticSampler(model).sample(ids, mask, s, EOS, PAD)
        got_ids, got_mask, got_lp = out.completion_ids, out.completion_mask, out.logprobs
    else:
        got_ids, got_mask, got_lp, _ = sample_batch(model, ids, mask, s, EOS, PAD)  # the decode loop's `_pick`
    with torch.no_grad():
        want, _ = token_logps(model, torch.cat([ids, got_ids], 1), torch.cat([mask, got_mask], 1),
                              got_ids.size(1), s.temperature)  # [B, C] fp32, one thread
    on = got_mask.bool()
    assert on.sum() > 20  # enough tokens to mean something
    torch.testing.assert_close(got_lp[on], want[on], atol=1e-5, rtol=1e-5)
    assert ((want - got_lp)[on].exp() - 1).abs().max() < 1e-4  # the weight is 1 on every token
    assert (got_lp[~on] == 0).all()


@pytest.mark.parametrize("explicit_sync", [True, False])
def test_kept_captures_see_an_optimizer_step(explicit_sync):
    # what CUDA runs, but for the graph: state and weights kept from call to call, refreshed in place on sync
    model = make_model()
    ids, mask = left_padded([5, 11, 3], repeat=2)
    s = SamplingConfig(max_new_tokens=8, temperature=0.8)
    u = draw_streams(6, generator=torch.Generator().manual_seed(9))
    kept = StaticSampler(model, keep_captures=True, full_cache_attention=True, buckets=True)
    first = kept.sample(ids, mask, s, EOS, PAD, streams=u)
    kept.sample(*left_padded([40, 2]), s, EOS, PAD)  # another bucket between the two calls
    again = kept.sample(ids, mask, s, EOS, PAD, streams=u)
    assert len(kept._captures) == 2 and torch.equal(first.completion_ids, again.completion_ids)
    with torch.no_grad():
        for p in model.parameters():  # an optimizer step, in place as optimizers step
            p.add_(torch.randn_like(p) * 0.05)
    if explicit_sync:
        kept.sync_weights(model)  # else the sampler sees the parameters' versions moved and syncs itself
    after = kept.sample(ids, mask, s, EOS, PAD, streams=u)
    fresh = StaticSampler(model).sample(ids, mask, s, EOS, PAD, streams=u)
    assert not torch.equal(first.logprobs, after.logprobs)
    assert torch.equal(after.completion_ids, fresh.completion_ids)
    assert torch.allclose(after.logprobs, fresh.logprobs, atol=1e-5)


def test_a_bf16_copy_decodes_the_bf16_models_numbers(monkeypatch):
    # the copy the trainer samples from under bf16 autocast: its steps agree with the bf16 model's own forward to
    # bf16's precision (a wrong weight, rotary or mask would be off by whole units)
    model = make_model(head_scale=4.0)
    ids, mask = left_padded([5, 11, 3])
    seen = recorded_logits(monkeypatch)
    sampler = StaticSampler(model, dtype=torch.bfloat16)
    out = sampler.sample(ids, mask, SamplingConfig(max_new_tokens=10), [], PAD)
    half = sampler._sampling_model()
    want = forward_logits(half, torch.cat([ids, out.completion_ids], 1),
                          torch.cat([mask, out.completion_mask], 1))[:, ids.size(1) - 1 : -1].float()  # [B, 10, V]
    got = torch.stack(seen, 1)  # [B, 10, V]
    assert (got - want).abs().max() < 0.1 < want.abs().max()


@pytest.mark.parametrize("tied", [False, True])
def test_the_bf16_copy_is_made_without_a_copy_in_the_models_dtype(tied):
    # the bytes made while making the copy are its bf16 parameters and the (fp32) buffers, not an fp32 duplicate
    # of the model first (deepcopy then cast: 3x the bf16 size at the peak); it samples what that copy samples
    model = make_model(head_scale=4.0)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    cast_copy = copy.deepcopy(model)
    for p in cast_copy.parameters():
        p.data = p.data.bfloat16()
    sampler = StaticSampler(model, dtype=torch.bfloat16)
    with BytesAlive() as alive:
        half = sampler._sampling_model()
    bf16 = sum(p.numel() * 2 for p in model.parameters())  # a tied weight once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert bf16 <= alive.peak <= bf16 + buffers + 1024  # and a few scalars
    assert (half.lm_head.weight is half.model.embed_tokens.weight) == tied
    for a, b in zip(half.parameters(), cast_copy.parameters(), strict=True):
        assert torch.equal(a, b) and a.dtype == torch.bfloat16 and not a.requires_grad
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32  # rounded, it would be off at long positions
    # the copy's q/k/v and gate/up are each one block of memory, which the step reads fused with no copy of its own
    step = read_weights(half, 4, pack=False)
    for layer, got in zip(half.model.layers, step.layers):
        assert got.qkv.weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr() and got.qkv.parts is None
        assert got.gate_up.weight.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
        assert torch.equal(got.gate_up.weight, torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))
    ids, mask = left_padded([5, 11, 3], repeat=2)
    s = SamplingConfig(max_new_tokens=8, temperature=0.8)
    u = draw_streams(6, generator=torch.Generator().manual_seed(10))
    got = sampler.sample(ids, mask, s, EOS, PAD, streams=u)
    want = StaticSampler(cast_copy).sample(ids, mask, s, EOS, PAD, streams=u)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.logprobs, want.logprobs)


def test_the_engine_samples_the_weights_a_fused_optimizer_stepped_once_synced():
    # a fused AdamW step leaves the parameters' version counters alone, so nothing on the tensors says they
    # changed: the engine's sync_weights (which the trainers call after each step) refreshes its bf16 copy
    from grpo.configs.model import ModelConfig, TinyModelConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.sampling.local.backend import TransformersBackend

    model, tok = load_model_and_tokenizer(ModelConfig(tiny=TinyModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)))
    prompts, s = ["Hi", "What is 2 + 3?"], SamplingConfig(max_new_tokens=6, temperature=0)
    backend = TransformersBackend(model, tok, dtype=torch.bfloat16)  # samples from a bf16 copy
    before = backend.generate(prompts, 2, s, logprobs=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    stale = backend.generate(prompts, 2, s, logprobs=True)
    backend.sync_weights()
    after = backend.generate(prompts, 2, s, logprobs=True)
    fresh = TransformersBackend(model, tok, dtype=torch.bfloat16).generate(prompts, 2, s, logprobs=True)
    assert torch.equal(before.logprobs, stale.logprobs)  # not synced: still the copy made before the step
    assert not torch.equal(before.logprobs, after.logprobs)
    assert torch.equal(after.completion_ids, fresh.completion_ids) and torch.equal(after.logprobs, fresh.logprobs)


def lora_model(seed: int = 0, **lora):
    """make_model with peft LoRA adapters on every projection, B made non-zero (peft starts it at 0, a no-op)."""
    from peft import LoraConfig, get_peft_model

    model = make_model(seed=seed, head_scale=4.0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=lora.pop("targets", targets),
                                                  **lora))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    return peft_model.eval()


@pytest.mark.parametrize("kept", [False, True])
def test_lora_adapters_are_computed_by_the_step(kept, monkeypatch):
    # the adapters' term in the step (not the decode loop): each step's logits are the peft model's own forward's
    model = lora_model()
    assert unsupported_reason(model) is None
    ids, mask = left_padded([5, 11, 3, 8], repeat=2)
    seen = recorded_logits(monkeypatch)
    sampler = StaticSampler(model, keep_captures=kept, full_cache_attention=kept, buckets=kept)
    out = sampler.sample(ids, mask, SamplingConfig(max_new_tokens=12), [], PAD)
    want = forward_logits(model, torch.cat([ids, out.completion_ids], 1),
                          torch.cat([mask, out.completion_mask], 1))[:, ids.size(1) - 1 : -1]  # [B, 12, V]
    with model.disable_adapter():  # the adapters matter: without them the logits are far off
        base = forward_logits(model, torch.cat([ids, out.completion_ids], 1),
                              torch.cat([mask, out.completion_mask], 1))[:, ids.size(1) - 1 : -1]
    got = torch.stack(seen, 1)
    assert fp32_gap(got, want) <= 1e-5 and 0.1 < (base - want).abs().max()


def test_kept_captures_see_an_adapter_step():
    # LoRA training steps only the adapters: the captured step's copies of them are rebuilt on sync
    model = lora_model()
    ids, mask = left_padded([5, 11, 3], repeat=2)
    s = SamplingConfig(max_new_tokens=8, temperature=0.8)
    u = draw_streams(6, generator=torch.Generator().manual_seed(9))
    kept = StaticSampler(model, keep_captures=True, full_cache_attention=True, buckets=True)
    first = kept.sample(ids, mask, s, EOS, PAD, streams=u)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    kept.sync_weights(model)
    after = kept.sample(ids, mask, s, EOS, PAD, streams=u)
    fresh = StaticSampler(model).sample(ids, mask, s, EOS, PAD, streams=u)
    assert not torch.equal(first.completion_ids, after.completion_ids)  # the step sampled from the new adapters
    assert torch.equal(after.completion_ids, fresh.completion_ids)
    assert torch.allclose(after.logprobs, fresh.logprobs, atol=1e-5)


def test_a_bf16_copy_of_a_lora_model_decodes_its_numbers(monkeypatch):
    # fp32 weights and adapters trained under bf16 autocast: the sampler's bf16 copy holds the adapters too
    model = lora_model()
    ids, mask = left_padded([5, 11, 3])
    seen = recorded_logits(monkeypatch)
    sampler = StaticSampler(model, dtype=torch.bfloat16)
    out = sampler.sample(ids, mask, SamplingConfig(max_new_tokens=10), [], PAD)
    full = torch.cat([ids, out.completion_ids], 1), torch.cat([mask, out.completion_mask], 1)
    half = sampler._sampling_model()  # the bf16 copy: a peft model too, with bf16 adapters
    want = forward_logits(half, *full)[:, ids.size(1) - 1 : -1].float()
    with half.disable_adapter():
        base = forward_logits(half, *full)[:, ids.size(1) - 1 : -1].float()
    got = torch.stack(seen, 1)
    # bf16 rounds the adapters' term in other places than peft's forward (a fused add): a few bf16 steps of the
    # logits apart, where leaving the adapters out is units apart
    assert (got - want).abs().mean() < 0.05 and (got - want).abs().max() < 0.25 < 1 < (base - want).abs().mean()


def test_lora_kinds_the_step_does_not_compute_are_refused():
    assert "variant" in unsupported_reason(lora_model(use_dora=True))
    assert "bias" in unsupported_reason(lora_model(lora_bias=True))
    assert "embedding" in unsupported_reason(lora_model(targets=["q_proj", "embed_tokens"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_steps_rms_norm_is_hfs_bit_for_bit(dtype):
    # the step's norms are one torch op (one kernel on CUDA, where a replayed step is bound by its kernel count);
    # on the CPU they must give transformers' Qwen2RMSNorm exactly, in fp32 and in bf16 (fp32 statistics)
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from grpo.sampling.local.cpu_decoder import rms_norm

    g = torch.Generator().manual_seed(0)
    for hidden in (64, 896):
        norm = Qwen2RMSNorm(hidden, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
        norm = norm.to(dtype)
        x = (torch.randn(32, hidden, generator=g) * 3).to(dtype)
        assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))
