"""The decode step's pieces on their own: the choice of a token in the logits' own memory, and weights packed by
oneDNN (`fp32_gemm`), against the model's forward and a float64 inverse CDF written apart."""

import pytest
import torch

from grpo.configs.sampling import SamplingConfig
from grpo.kernels.gemm import onednn_packed_problem
from grpo.sampling.local import cpu_decoder
from grpo.sampling.local.decode_step import choose_tokens
from grpo.sampling.local.static_sampler import StaticSampler
from tiny_decoders import PAD, forward_logits, fp32_gap, left_padded, make_model, recorded_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)


@pytest.mark.skipif(onednn_packed_problem() is not None, reason="this torch cannot pack weights with oneDNN")
def test_weights_packed_by_onednn_step_the_model_s_logits(monkeypatch):
    # fp32_gemm: onednn (or auto where oneDNN measures faster) packs the step's weights with oneDNN, whose products
    # round otherwise than MKL's: the logits stay the model's forward's within fp32 rounding
    model = make_model("qwen2", head_scale=4.0)
    ids, mask = left_padded([5, 11, 3, 8], repeat=2)
    seen = recorded_logits(monkeypatch)
    libraries = []
    packed = cpu_decoder.PackedLinear.__init__
    monkeypatch.setattr(cpu_decoder.PackedLinear, "__init__",
                        lambda self, *a: packed(self, *a) or libraries.append(self.library))
    out = StaticSampler(model, fp32_gemm="onednn").sample(ids, mask, SamplingConfig(max_new_tokens=12), [], PAD)
    assert libraries and set(libraries) == {"onednn"} and len(seen) == 12
    want = forward_logits(model, torch.cat([ids, out.completion_ids], 1),
                          torch.cat([mask, out.completion_mask], 1))[:, ids.size(1) - 1 : -1]  # [B, 12, V]
    got = torch.stack(seen, 1)
    assert got.abs().max() > 1 and fp32_gap(got, want) <= 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_choosing_in_the_logits_own_memory_picks_the_tokens_of_the_softmax(temperature):
    # the decode step hands its logits over (scratch): divided and exponentiated in place, no [B, V] tensor more
    gen = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(256, 1500, generator=gen)  # [B, V]
    u = torch.rand(256, generator=gen)  # [B]
    s = SamplingConfig(max_new_tokens=4, temperature=temperature)
    want, _ = choose_tokens(logits, u, s, want_logprobs=False)
    kept = logits.clone()
    got, _ = choose_tokens(logits, u, s, want_logprobs=False, scratch=True)
    assert not torch.equal(logits, kept)  # it did use their memory
    assert torch.equal(got, want)
    # and the inverse CDF at each row's u, written apart in float64: the first token whose cumulative mass reaches
    # (1 - u) of the total
    p = torch.softmax(kept.double() / temperature, -1)
    first = (p.cumsum(-1) >= (1 - u.double())[:, None] * p.sum(-1, keepdim=True)).int().argmax(-1)
    assert (got == first).float().mean() >= 0.99  # float32 and float64 sums may part at a boundary, rarely
