"""Packed (padding-free) rows: the packer's invariants on random rows, and packed numbers against padded ones.

Where numbers are compared: float32, one thread, bounds relative to the values (GEMM libraries round differently on
each CPU). The models are real tiny Qwen2 (and Qwen3, which the packed kernel does not take) built from a config.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from grpo.training.packing import pack_completions, pack_in_order, reference_parts, row_spans

V, PAD = 64, 0


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(kind: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if kind == "qwen2" else Qwen3ForCausalLM(
        Qwen3Config(**common, head_dim=8))
    with torch.no_grad():
        for p in model.parameters():  # biases and norm weights start at 0 and 1: make them matter
            p.add_(torch.randn_like(p) * 0.05)
        model.lm_head.weight.mul_(10.0)  # peakier distributions than a random init's near-uniform
    return model.float()


def grpo_rows(prompt_lens: list[int], completion_lens: list[int], group: int, seed: int = 1):
    """Rows as GRPO makes them: `group` rows a prompt (the same tokens), left-padded prompts, right-padded
    completions. prompt_lens: one a group; completion_lens: one a row."""
    g = torch.Generator().manual_seed(seed)
    N, P, C = len(completion_lens), max(prompt_lens), max(max(completion_lens), 1)
    ids = torch.full((N, P + C), PAD)
    mask = torch.zeros(N, P + C, dtype=torch.long)
    for r, c in enumerate(completion_lens):
        p = prompt_lens[r // group]
        if r % group == 0:
            prompt = torch.randint(1, V, (p,), generator=g)
        ids[r, P - p:P], mask[r, P - p:P] = prompt, 1
        ids[r, P:P + c], mask[r, P:P + c] = torch.randint(1, V, (c,), generator=g), 1
    return ids, mask, C


# -- the packer ----------------------------------------------------------------------------------------------------

def test_pack_in_order_holds_its_invariants_on_random_rows():
    rng = random.Random(0)
    for _ in range(300):
        budget = rng.randint(1, 60)
        tokens = [rng.randint(1, budget) for _ in range(rng.randint(1, 40))]
        batches = pack_in_order(tokens, budget)
        assert [i for b in batches for i in b] == list(range(len(tokens)))  # none lost, none twice, in order
        assert all(b and sum(tokens[i] for i in b) <= budget for b in batches)  # none empty, none over budget
        # next-fit: a micro-batch closed only because the next row did not fit
        assert all(sum(tokens[i] for i in a) + tokens[b[0]] > budget for a, b in zip(batches, batches[1:]))


def test_a_row_over_the_budget_is_an_error_naming_it():
    with pytest.raises(ValueError, match=r"row 2 has 9 tokens, more than max_tokens_per_microbatch=8"):
        pack_in_order([3, 4, 9, 1], 8)


def test_reference_parts_split_a_micro_batch_by_the_row_count_ones():
    assert reference_parts([0, 1, 2, 3, 4], 2) == [([0, 1], slice(0, 2)), ([2, 3], slice(2, 4)), ([4], slice(4, 6))]
    assert reference_parts([5], 4) == [([0], slice(4, 8))]


@pytest.mark.parametrize("share", [True, False])
def test_packed_rows_hold_every_real_token_once_with_positions_from_zero(share):
    rng = random.Random(1)
    for trial in range(40):
        group = rng.randint(1, 4)
        n_groups = rng.randint(1, 4)
        prompts = [rng.randint(1, 6) for _ in range(n_groups)]
        completions = [rng.randint(0, 9) for _ in range(group * n_groups)]
        ids, mask, C = grpo_rows(prompts, completions, group, seed=trial)
        packed = pack_completions(ids, mask, C, share_prompts=share)
        flat, pos = packed.input_ids[0].tolist(), packed.position_ids[0].tolist()
        segs = packed.segments.segments
        assert segs[0].start == 0 and segs[-1].end == len(flat)
        assert all(a.end == b.start for a, b in zip(segs, segs[1:]))  # the sequences cover the row, in order
        for s in segs:  # positions: from 0, or from the prompt's length where a completion reads its prompt
            first = s.prefix_end - s.prefix_start
            assert pos[s.start:s.end] == list(range(first, first + s.end - s.start))
        assert PAD not in flat  # no padding
        # each row's tokens read back: the sequence a completion token is predicted from is the row's real tokens
        P = ids.size(1) - C
        predictors = packed.predictors.tolist()
        k = 0
        for r in range(ids.size(0)):
            real = ids[r][mask[r].bool()].tolist()
            for j in range(completions[r]):
                at = predictors[k]
                seg = next(s for s in segs if s.start <= at < s.end)
                seen = flat[seg.prefix_start:seg.prefix_end] + flat[seg.start:at + 1]  # what that position reads
                assert seen == real[:len(real) - completions[r] + j]
                assert ids[r, P + j].item() == real[len(real) - completions[r] + j]
                k += 1
        assert k == len(predictors) == int(packed.valid.sum())
        # the packed row is every real token but each fed row's last, prompts once a group when shared
        fed = [r for r in range(ids.size(0)) if completions[r]]
        expect = sum(prompts[r // group] + completions[r] - 1 for r in fed)
        if share:
            expect -= sum(prompts[r // group] for r in fed) - sum(prompts[g] for g in {r // group for r in fed})
        assert len(flat) == max(expect, 1)


def test_a_row_that_is_not_prompt_then_completion_is_refused_by_name():
    ids, mask, C = grpo_rows([3], [2, 2], 2)
    mask[1, -C] = 0  # a hole between the prompt and the completion
    with pytest.raises(ValueError, match="row 1: its tokens are not a left-padded prompt"):
        row_spans(mask, C)
