"""Packed (padding-free) rows: the packer's invariants on random rows, and packed numbers against padded ones.

Where numbers are compared: float32, one thread, bounds relative to the values (GEMM libraries round differently on
each CPU). The models are real tiny Qwen2 (and Qwen3, which the packed kernel does not take) built from a config.
"""

from __future__ import annotations

import random

import pytest
import torch

from comparisons import close
from grpo.kernels.attention import attending_packed
from grpo.training.packing import pack_completions, pack_in_order, reference_parts, row_spans
from packing_inputs import PAD, grpo_rows, make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread where numbers are compared (conftest)


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


# -- packed log-probs against padded ones --------------------------------------------------------------------------

@pytest.mark.parametrize("kind,head", [("qwen2", "plain"), ("qwen2", "chunked"), ("qwen3", "plain")])
def test_packed_logps_and_gradients_equal_the_padded_ones(kind, head):
    """Qwen2 takes the packed kernel (prompts shared); Qwen3 transformers' own packed mask from the position ids
    (the kernel does not take it).
    Rows of one token, of none, and groups sharing a prompt are in the batch."""
    from grpo.training.logprobs import token_logps

    model = make_model(kind).train()
    ids, mask, C = grpo_rows([3, 5, 2], [7, 1, 4, 0, 2, 6, 3, 3, 5], group=3)
    valid = mask[:, -C:].bool()
    kw = dict(plain_max_bytes=0, chunk_tokens=5) if head == "chunked" else {}
    weights = torch.randn(ids.size(0), C, generator=torch.Generator().manual_seed(2))
    out = {}
    for packed in (False, True):
        model.zero_grad()
        with attending_packed(model, packed):
            logps, entropy = token_logps(model, ids, mask, C, 0.7, with_entropy=True, packed=packed, **kw)
        (logps * weights * valid).sum().backward()
        out[packed] = (logps[valid], entropy[valid], [p.grad.clone() for p in model.parameters()])
    assert close(out[True][0], out[False][0]) and close(out[True][1], out[False][1])
    assert all(close(a, b, 1e-4) for a, b in zip(out[True][2], out[False][2]))
    assert model.config._attn_implementation == "sdpa"  # the packed kernel was switched back


# -- the GRPO loop -------------------------------------------------------------------------------------------------

def make_trainer(tmp_path, **overrides):
    import pandas as pd

    from grpo.configs.sampling import SamplingConfig
    from grpo.configs.training import GRPOConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.grpo_trainer import GRPOTrainer
    from tiny_configs import SMALL

    prompts = pd.DataFrame({"prompt": [f"Say {i}{'!' * (3 * i)}" for i in range(8)], "answer": list("01234567")})
    model, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(**{"max_steps": 1, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=16), "rewards": {"digits": 1.0},
                        "mixed_precision": "no", "fp32_gemm": "mkl", **overrides})
    digits = {"digits": lambda completions, **_: [float(sum(ch.isdigit() for ch in c)) for c in completions]}
    seen = {}
    trainer = GRPOTrainer(model, tok, prompts, cfg, tmp_path, reward_functions=digits, progress=False,
                          on_metrics=lambda step, m: seen.__setitem__(step, m))
    return trainer, seen


def step_gradients(trainer, batch, **cfg) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The gradients one optimizer step of `optimise` applies with these settings, and its figures; the weights are
    put back after."""
    grads = {}

    def record(optimizer, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})

    handle = trainer.optimizer.optimizer.register_step_pre_hook(record)
    trainer.cfg = trainer.cfg.updated(**cfg)
    trainer.packed = cfg.get("packing", False)
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    try:
        stats = trainer.optimise(batch)
    finally:
        handle.remove()
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                p.copy_(weights[n])
    return grads, stats


def test_packed_grpo_steps_equal_padded_ones_for_every_loss_type(tmp_path):
    """Micro-batches of 3 rows padded, the same packed, and packed to a 50-token budget (other rows together): the
    same gradients and loss for every loss type, bnpo's token mean per row-count micro-batch included."""
    torch.manual_seed(0)
    trainer, _ = make_trainer(tmp_path, beta=0.04, num_iterations=2)
    rollout = trainer.sample([0, 5])  # prompts of different lengths: left padding in the batch
    completion_mask = rollout.completion_mask.clone()
    completion_mask[:3, 4:] = 0  # the first micro-batch holds fewer tokens than its share of rows
    rollout = rollout._replace(completion_mask=completion_mask)
    batch = trainer.build_batch(rollout, [float(i % 3) for i in range(8)])
    tokens = batch.attention_mask.sum(1)
    assert tokens.min() < tokens.max() and int(tokens.max()) <= 50 < int(tokens.sum())  # several budgeted batches
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        padded, padded_stats = step_gradients(trainer, batch, loss_type=loss_type, micro_batch_size=3, packing=False)
        for budget in (None, 50):
            packed, stats = step_gradients(trainer, batch, loss_type=loss_type, micro_batch_size=3, packing=True,
                                           max_tokens_per_microbatch=budget)
            assert all(close(packed[n], g, 1e-4) for n, g in padded.items()), (loss_type, budget)
            assert stats["train/loss"] == pytest.approx(padded_stats["train/loss"], rel=1e-5, abs=1e-7)


def test_a_token_budget_that_cannot_hold_a_row_fails_before_sampling(tmp_path):
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=20 cannot hold prompt row 7"):
        make_trainer(tmp_path, max_tokens_per_microbatch=20)
    with pytest.raises(ValueError, match="needs packing"):
        make_trainer(tmp_path, packing=False, max_tokens_per_microbatch=200)


def test_a_short_grpo_run_packed_matches_the_padded_one(tmp_path):
    """Two steps (mu 2, KL to the reference): the same figures and weights as the padded run, to fp32 rounding."""
    runs = {}
    for packing in (False, True):
        torch.manual_seed(0)
        trainer, seen = make_trainer(tmp_path / str(packing), packing=packing, max_steps=2, num_iterations=2,
                                     learning_rate=1e-3, max_tokens_per_microbatch=60 if packing else None)
        assert trainer.packed == packing
        trainer.train()
        runs[packing] = seen, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    for step in (1, 2):
        for key in ("train/loss", "kl", "reward/total", "entropy", "grad_norm"):
            assert packed[step][key] == pytest.approx(padded[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert all(close(w_packed[n], w, 1e-5) for n, w in w_padded.items())


# -- the SFT loop --------------------------------------------------------------------------------------------------

def test_a_packed_sft_run_matches_the_padded_one(tmp_path):
    """Rows of uneven lengths: three steps of packed SFT give the padded run's losses and weights to fp32 rounding
    (each sequence's first label is dropped, so no token is predicted across a boundary)."""
    import pandas as pd

    from grpo.configs.training import SFTConfig
    from grpo.models import load_model_and_tokenizer
    from grpo.training.loops.sft_trainer import train_sft
    from tiny_configs import SMALL

    rows = pd.DataFrame({"prompt": [f"What is {i} + 1?{' ' * i}" for i in range(8)],
                         "response": [f"{i + 1}" + " and so on" * (i % 4) for i in range(8)]})
    runs = {}
    for packing in (False, True):
        model, tok = load_model_and_tokenizer(SMALL)
        cfg = SFTConfig(max_steps=3, batch_size=4, learning_rate=3e-3, warmup_steps=0, log_every=1,
                        checkpoint_every=0, mixed_precision="no", fp32_gemm="mkl", packing=packing)
        seen = {}
        result = train_sft(model, tok, rows, cfg, tmp_path / str(packing), lambda s, m: seen.__setitem__(s, m),
                           progress=False)
        runs[packing] = seen, type(model).from_pretrained(result.model_dir).state_dict()
    (padded, w_padded), (packed, w_packed) = runs[False], runs[True]
    assert [packed[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx(
        [padded[s]["train/loss"] for s in (1, 2, 3)], rel=1e-5)
    assert all(close(w_packed[n], w, 1e-5) for n, w in w_padded.items())
