"""The lean decode path: the same tokens and log-probs as transformers' own forward, on Qwen2 and Llama models."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from benchmarks.bytes_alive import BytesAlive
from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.configs.sampling import GenerationConfig, SamplingConfig
from grpo.models import load_model_and_tokenizer
from grpo.sampling.draws import draw_streams, uniform_at
from grpo.sampling.engines import build_engine
from grpo.sampling.local import backend, cpu_decoder
from grpo.sampling.local.backend import TransformersBackend, render_prompts, sample_batch
from grpo.sampling.local.cpu_decoder import lean_decode_supported
from grpo.sampling.local.decode_step import inverse_cdf
from grpo.tiny import build_tokenizer

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)
# different lengths, so the batch is left-padded; each prompt is repeated n times in a batch
PROMPTS = ["What is 2 + 3?", "Hi", [{"role": "user", "content": "A longer prompt with more words in it."}]]


def _qwen2():
    return load_model_and_tokenizer(ModelConfig(tiny=SMALL))


def _llama():
    """A Llama with everything the lean step must honour: biases, untied head, non-unit norms, GQA."""
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        for p in model.parameters():  # biases and norm weights start at 0 and 1: make them matter
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval(), tok


def _llama_tied():
    """SmolLM2's shape in small: a Llama with grouped-query attention and its output layer tied to the embeddings."""
    from gguf_files import small_llama

    model, tok = small_llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model, tok


def _encode(tok, n: int):
    enc = tok(render_prompts(tok, PROMPTS), padding=True, return_tensors="pt", add_special_tokens=False)
    return enc["input_ids"].repeat_interleave(n, 0), enc["attention_mask"].repeat_interleave(n, 0)


def _hf_only(monkeypatch):
    monkeypatch.setattr(cpu_decoder.LeanDecoder, "build", classmethod(lambda cls, *a, **k: None))


@pytest.mark.parametrize("make", [_qwen2, _llama, _llama_tied])
def test_lean_path_is_taken_for_qwen2_and_llama(make):
    model, _ = make()
    assert lean_decode_supported(model)


def test_other_architectures_fall_back_to_the_transformers_loop():
    tok = build_tokenizer()
    mistral = MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert not lean_decode_supported(mistral)
    model, tok = _qwen2()
    model.config.hidden_act = "gelu"  # an MLP the lean step does not compute
    assert not lean_decode_supported(model)
    out = TransformersBackend(model, tok).generate(PROMPTS, 2, SamplingConfig(max_new_tokens=5, temperature=0))
    assert out.completion_ids.shape == (6, 5)


def test_a_model_with_hooks_decodes_through_its_own_forward():
    model, tok = _qwen2()
    banned = list(range(len(tok) // 2))  # the first half of the vocabulary
    out = TransformersBackend(model, tok).generate(PROMPTS, 4, SamplingConfig(max_new_tokens=12, temperature=2.0))
    assert torch.isin(out.completion_ids, torch.tensor(banned)).any()  # a random model writes some

    def ban(module, args, logits):  # a logit mask as a forward hook: the lean step would skip it
        logits[..., banned] = -1e4
        return logits

    model.get_output_embeddings().register_forward_hook(ban)
    assert not lean_decode_supported(model)
    out = TransformersBackend(model, tok).generate(PROMPTS, 4, SamplingConfig(max_new_tokens=12, temperature=2.0))
    assert not torch.isin(out.completion_ids, torch.tensor(banned)).any()


# 24: within the lean cache's first room; 150: no end token, so every row writes past it twice (64, 128, 150)
@pytest.mark.parametrize(("new", "stop"), [(24, True), (150, False)])
@pytest.mark.parametrize("make", [_qwen2, _llama, _llama_tied])
def test_lean_greedy_decode_matches_the_transformers_loop(make, new, stop, monkeypatch):
    model, tok = make()
    ids, mask = _encode(tok, n=2)
    s = SamplingConfig(max_new_tokens=new, temperature=0)
    eos = [tok.eos_token_id] if stop else []
    lean = sample_batch(model, ids, mask, s, eos, tok.pad_token_id)
    assert stop or lean[0].size(1) == new
    _hf_only(monkeypatch)
    hf = sample_batch(model, ids, mask, s, eos, tok.pad_token_id)
    assert torch.equal(lean[0], hf[0]) and torch.equal(lean[1], hf[1]) and torch.equal(lean[3], hf[3])
    assert torch.allclose(lean[2], hf[2], atol=1e-5)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("make", [_qwen2, _llama, _llama_tied])
def test_lean_sampled_logprobs_match_a_full_forward_pass(make, n):
    model, tok = make()
    ids, mask = _encode(tok, n=n)
    # n = 1: every row distinct, listed out of sorted order, so the shared prefill must put each row's cache back
    _, first = backend.distinct_rows(torch.cat([ids, mask], 1))
    assert not torch.equal(first, torch.arange(ids.size(0))) or n > 1
    torch.manual_seed(0)
    s = SamplingConfig(max_new_tokens=20, temperature=0.7)
    completion_ids, completion_mask, logprobs, _ = sample_batch(model, ids, mask, s, [tok.eos_token_id],
                                                                tok.pad_token_id)
    full_ids, full_mask = torch.cat([ids, completion_ids], 1), torch.cat([mask, completion_mask], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=pos).logits
    P = ids.shape[1]
    expected = torch.log_softmax(logits[:, P - 1 : -1] / 0.7, -1).gather(-1, completion_ids[..., None]).squeeze(-1)
    assert torch.allclose(expected * completion_mask, logprobs, atol=1e-4)


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_lean_linear_gives_f_linear_numbers(bias, copies):
    torch.manual_seed(0)
    mods = [torch.nn.Linear(32, n, bias=bias) for n in (48, 16, 16)]  # q, k, v
    x = torch.randn(5, 32)  # [rows, in]
    want = torch.cat([m(x) for m in mods], -1)
    lin = cpu_decoder.PackedLinear(mods, rows=5, copies=copies)
    assert (lin.parts is None) == copies  # fused into one matrix only when copies are allowed
    assert (lin.packed is not None) == (copies and torch.backends.mkl.is_available())  # and then packed for MKL
    assert torch.allclose(lin(x), want, atol=1e-6)
    half = cpu_decoder.PackedLinear([m.bfloat16() for m in mods], rows=5, copies=copies)
    assert half.packed is None  # MKL packs fp32 only: other dtypes take F.linear
    assert torch.allclose(half(x.bfloat16()).float(), torch.cat([m(x.bfloat16()) for m in mods], -1).float())


def test_a_large_model_decodes_from_its_own_weights(monkeypatch):
    model, tok = _llama()
    ids, mask = _encode(tok, n=2)
    s = SamplingConfig(max_new_tokens=12, temperature=0)
    built = []
    build = cpu_decoder.LeanDecoder.build.__func__
    monkeypatch.setattr(cpu_decoder.LeanDecoder, "build",
                        classmethod(lambda cls, *a: built.append(build(cls, *a)) or built[-1]))
    small = sample_batch(model, ids, mask, s, [tok.eos_token_id], tok.pad_token_id)
    monkeypatch.setattr(cpu_decoder, "COPY_MAX_BYTES", 0)  # as if the model were over the limit
    large = sample_batch(model, ids, mask, s, [tok.eos_token_id], tok.pad_token_id)
    for w, layer in zip(built[1].layers, model.model.layers):  # no fused or packed copy: the modules' own weights
        qkv = (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight)
        assert all(got is want for (got, _), want in zip(w.qkv.parts, qkv))
        assert w.down.weight is layer.mlp.down_proj.weight and w.gate_up.parts is not None
        assert all(lin.packed is None for lin in (w.qkv, w.o, w.gate_up, w.down))
    assert torch.equal(small[0], large[0]) and torch.allclose(small[2], large[2], atol=1e-5)


def test_draw_follows_the_distribution_and_never_picks_a_zero_probability():
    # each row's draw at step 0 of its own stream, and one row's draws along its steps: both follow the distribution
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]]).repeat(5000, 1)
    streams = draw_streams(10000, generator=torch.Generator().manual_seed(0))
    tok = inverse_cdf(probs, uniform_at(streams, 0))  # [10000]
    along = inverse_cdf(probs, uniform_at(streams[:1].expand(10000), torch.arange(10000) // 2))  # [10000]
    for got in (tok, along):
        counts = torch.zeros_like(probs[:2])
        for row in range(2):
            counts[row] = torch.bincount(got[row::2], minlength=6).float() / 5000
        assert (counts[probs[:2] == 0] == 0).all()
        assert torch.allclose(counts, probs[:2], atol=0.03)


def test_the_loop_holds_kv_by_the_rows_lengths_not_the_budget(one_thread_everywhere):
    """`sampler: loop` at a 4096-token budget whose rows all end within a few tokens: the bytes it holds at its peak
    are those of the same run at a budget of 64, far below one K/V cache at the budget, and the tokens the same."""
    model, tok = _qwen2()  # fp32
    assert lean_decode_supported(model)
    engine = build_engine(GenerationConfig(sampler="loop"), model, tok)
    ids, mask = _encode(tok, n=4)  # [12, P]
    stop = list(range(0, len(tok), 2))  # half the vocabulary ends a row: each token ends it with p ~ 1/2
    runs = {}
    for budget in (64, 4096):
        torch.manual_seed(0)  # each row's random stream
        with BytesAlive() as alive:  # tensors made by the call, alive at once
            out = engine.sample_ids(ids, mask, SamplingConfig(max_new_tokens=budget, temperature=1.0), eos_ids=stop)
        runs[budget] = out, alive.peak
    (short, peak_short), (long, peak_long) = runs[64], runs[4096]
    assert short[0].size(1) < 16 and not short[3].any()  # every row ended within a few tokens
    assert all(torch.equal(a, b) for a, b in zip(short, long))  # the same tokens, mask, log-probs and ends
    cfg = model.config
    # a cache sized by the budget: K and V, 2 layers, 12 rows of P + 4096 positions, 2 KV heads of 16, fp32:
    # 2 * 2 * 12 * (P + 4096) * 2 * 16 * 4 B ~ 25 MB (what the lean step allocated up front before it grew)
    at_budget = 2 * cfg.num_hidden_layers * ids.size(0) * cfg.num_key_value_heads * (ids.size(1) + 4096) \
        * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert peak_long == peak_short < at_budget / 10
