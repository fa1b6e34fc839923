"""The CPU training attention: SDPA's numbers and gradients, restored afterwards, used only where it is exact."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.kernels.attention import NAME, cpu_attention, grouped_attention_supported
from grpo.models import load_model_and_tokenizer
from grpo.tiny import build_tokenizer
from grpo.training.logprobs import token_logps

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)


def _batch(tok, n: int = 3):
    """Left-padded prompts of different lengths, each with n completions of 7 tokens (a GRPO batch)."""
    enc = tok(["What is 2 + 3?", "Hi", "A longer prompt with more words in it."], padding=True, padding_side="left",
              return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"].repeat_interleave(n, 0)
    mask = enc["attention_mask"].repeat_interleave(n, 0)
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(0, 200, (ids.size(0), 7), generator=g)
    return torch.cat([ids, completion], 1), torch.cat([mask, torch.ones_like(completion)], 1)


@pytest.fixture(scope="module")
def qwen2():
    model, tok = load_model_and_tokenizer(ModelConfig(tiny=SMALL))
    with torch.no_grad():
        for p in model.parameters():  # biases and norm weights start at 0 and 1: make them matter
            p.add_(torch.randn_like(p) * 0.05)
    return model, tok


def _logps_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logps, _ = token_logps(model, ids, mask, 7, temperature=1.0)  # [N, 7]; shares each prompt's pass
    (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grouped_attention_gives_sdpa_numbers_and_gradients(qwen2):
    model, tok = qwen2
    model.train()
    ids, mask = _batch(tok)
    assert model.config._attn_implementation == "sdpa"
    want, want_grads = _logps_and_grads(model, ids, mask)
    with cpu_attention(model):
        assert model.config._attn_implementation == NAME
        got, grads = _logps_and_grads(model, ids, mask)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    # and the plain forward (no shared prompt pass): every row, every position
    with torch.no_grad(), cpu_attention(model):
        logits = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()  # left padding's rows attend to nothing; their outputs are not used by anyone
    torch.testing.assert_close(logits[real], ref[real], rtol=1e-5, atol=1e-5)


def test_the_model_gets_its_own_attention_back_after_an_error(qwen2):
    model, _ = qwen2
    with pytest.raises(RuntimeError, match="boom"), cpu_attention(model, None):
        assert model.config._attn_implementation == NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_only_exact_cases_are_switched(qwen2):
    model, _ = qwen2
    assert grouped_attention_supported(model)
    tok = build_tokenizer()
    sliding = MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               sliding_window=8))
    assert not grouped_attention_supported(sliding)  # another architecture (and a window the function ignores)
    windowed = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                            use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert not grouped_attention_supported(windowed)  # the right architecture, but a window the function ignores
    model.set_attn_implementation("eager")
    try:
        assert grouped_attention_supported(model)
        with cpu_attention(model):
            assert model.config._attn_implementation == NAME
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")
    assert not grouped_attention_supported(torch.nn.Linear(2, 2))
