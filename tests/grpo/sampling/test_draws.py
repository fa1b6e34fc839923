"""Each row's counter-based random stream (grpo.sampling.draws): SplitMix64 as published, draws that follow the
distribution, and a seed that samples the same tokens at any budget its rows do not reach, through the slots and the
step-by-step decode loop alike."""

import pytest
import torch

from grpo.configs.sampling import SamplingConfig
from grpo.sampling.draws import draw_streams, uniform_at
from grpo.sampling.local.backend import sample_batch
from grpo.sampling.local.static_sampler import StaticSampler
from tiny_decoders import EOS, PAD, left_padded, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)
MASK = (1 << 64) - 1


def splitmix64(seed: int, k: int) -> float:
    """Token k's draw of a stream, in plain Python integers: SplitMix64's k-th output (Steele et al., 2014)."""
    z = (seed + (k + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def test_the_draws_are_splitmix64_at_every_step():
    streams = torch.tensor([0, 1, -1, 2**62, -(2**63), 1234567890123])
    for k in (0, 1, 2, 511, 16383, 10**9):
        want = torch.tensor([splitmix64(int(s) & MASK, k) for s in streams], dtype=torch.float64)
        assert torch.equal(uniform_at(streams, k), want)  # one step for every row
        assert torch.equal(uniform_at(streams, torch.full_like(streams, k)), want)  # each row at its own step
    u = uniform_at(draw_streams(50_000, generator=torch.Generator().manual_seed(0)), 3)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005


def test_streams_drawn_a_batch_at_a_time_are_the_streams_drawn_at_once():
    whole = draw_streams(10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draw_streams(10, per=4, generator=torch.Generator().manual_seed(3)), whole)
    torch.manual_seed(3)
    assert torch.equal(draw_streams(10), whole)  # torch's own generator, as `torch.manual_seed` fixes a run


@pytest.mark.parametrize("budget", [4096, 16384])
def test_a_seed_samples_the_same_tokens_at_any_budget_its_rows_do_not_reach(budget):
    model = make_model(head_scale=1.0, positions=budget + 16)  # near-uniform over 96 with 12 end ids: short rows
    ids, mask = left_padded([5, 11, 3, 7], repeat=2)
    short, long = (SamplingConfig(max_new_tokens=c, temperature=1.0) for c in (256, budget))
    torch.manual_seed(21)
    want = StaticSampler(model).sample(ids, mask, short, EOS, PAD)
    assert not want.truncated.any()  # every row ended well within the short budget
    torch.manual_seed(21)
    got = StaticSampler(model).sample(ids, mask, long, EOS, PAD)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.logprobs, want.logprobs)
    torch.manual_seed(21)
    loop = sample_batch(model, ids, mask, long, EOS, PAD)  # the step-by-step decode loop, same seed
    assert torch.equal(loop[0], want.completion_ids) and torch.allclose(loop[2], want.logprobs, atol=1e-5)
