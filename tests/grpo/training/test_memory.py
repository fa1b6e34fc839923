"""The GRPO recipe's memory knobs on a real tiny model: bf16 weights with fp32 master weights, bitsandbytes' 8-bit
AdamW, LoRA adapters through peft (the reference is the base with adapters off, no copy of the model)."""

import copy
import sys

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo.training.policy as policy
from benchmarks.bytes_alive import BytesAlive
from grpo.configs.lora import LoRAConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.training.logprobs import token_logps
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.optimizers import MasterWeights, cast_parameters, make_adamw
from tiny_configs import SMALL

pytestmark = pytest.mark.precision  # trains under `auto`: `make test` runs it under either CPU answer

PROMPTS = pd.DataFrame({"prompt": [f"Say {i}" for i in range(8)], "answer": [str(i) for i in range(8)]})


def digits(completions, **_):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def make_trainer(tmp_path, model=None, **overrides):
    base, tok = load_model_and_tokenizer(SMALL)
    cfg = GRPOConfig(**{"max_steps": 1, "prompts_per_step": 2, "num_generations": 4, "checkpoint_every": 0,
                        "sampling": SamplingConfig(max_new_tokens=8), "rewards": {"digits": 1.0},
                        "learning_rate": 1e-2, **overrides})
    return GRPOTrainer(model or base, tok, PROMPTS, cfg, tmp_path, reward_functions={"digits": digits},
                       progress=False)


def _batch(trainer):
    torch.manual_seed(0)
    rollout = trainer.sample([0, 1])
    return trainer.build_batch(rollout, [float(i % 3) for i in range(8)]), rollout.completion_ids.size(1)


# -- bf16 weights with fp32 masters --------------------------------------------------------------------------------

def test_master_weights_step_like_fp32_adamw_and_round_into_the_model():
    """Same gradients: the masters follow fp32 AdamW exactly, the model holds them rounded to bf16. AdamW on the
    bf16 weights themselves loses updates below bf16's resolution (lr 1e-4 on weights near 1: nothing moves)."""
    torch.manual_seed(0)
    fp32 = torch.nn.Linear(16, 4)
    with torch.no_grad():
        fp32.weight.add_(1.0)  # weights near 1: bf16 steps of 2^-8 there
    bf16, naive = copy.deepcopy(fp32), copy.deepcopy(fp32)
    opt32 = torch.optim.AdamW(fp32.parameters(), lr=1e-4)
    master = MasterWeights(list(bf16.parameters()), lambda ps: torch.optim.AdamW(ps, lr=1e-4))
    cast_parameters(bf16, torch.bfloat16)
    cast_parameters(naive, torch.bfloat16)
    opt_naive = torch.optim.AdamW(naive.parameters(), lr=1e-4)
    start = naive.weight.detach().clone()
    for _ in range(5):
        grads = [torch.randn_like(p).bfloat16() for p in fp32.parameters()]  # what a bf16 backward would give
        for model in (fp32, bf16, naive):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.to(p.dtype)
        opt32.step(), master.step(), opt_naive.step()
        master.zero_grad()
    for p32, m, p16 in zip(fp32.parameters(), master.masters, bf16.parameters()):
        torch.testing.assert_close(m, p32.detach(), rtol=0, atol=0)
        assert p16.dtype == torch.bfloat16 and torch.equal(p16.detach(), p32.detach().bfloat16())
        assert p16.grad is None and m.grad is None
    assert torch.equal(naive.weight.detach(), start)  # five updates of ~5e-4 each, all rounded away
    assert not torch.equal(fp32.weight.detach().bfloat16(), start)


def _stepped(slice_bytes, steps=3):
    """(masters after `steps` MasterWeights steps of one bf16 MLP, most bytes made at once by the last step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = MasterWeights(list(model.parameters()), lambda ps: make_adamw(ps, 1e-3, 0.1),  # fused, as in training
                        slice_bytes=slice_bytes)
    cast_parameters(model, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()  # [*p.shape] what a bf16 backward gives
        with BytesAlive() as alive:  # the last step: the optimizer's state is already there
            opt.step()
        opt.zero_grad()
    return [m.detach().clone() for m in opt.masters], alive.peak, opt


def test_master_weights_step_a_slice_at_a_time_as_all_at_once():
    """Slices of 70 KiB of fp32 gradients (a layer each) give bit for bit the masters of one step over all the
    parameters, and the step holds one slice's fp32 gradients at a time instead of all of them (129 KiB)."""
    whole, peak_whole, _ = _stepped(2**40)
    sliced, peak_sliced, opt = _stepped(70 * 2**10)
    assert [list(s) for s in opt.slices] == [[0, 1], [2, 3]]  # 64x256 weights (64 KiB) and their biases
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)
    grads = sum(m.numel() * 4 for m in opt.masters)
    assert peak_whole >= grads  # an fp32 copy of every gradient alive together
    assert peak_sliced <= (256 * 64 + 256) * 4 + 1024  # the largest slice (measured: exactly it), a few scalars


def test_master_weights_state_dict_carries_the_masters():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = MasterWeights(list(model.parameters()), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    cast_parameters(model, torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    state = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    twin_opt = MasterWeights(list(twin.parameters()), lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    twin_opt.load_state_dict(state)
    for a, b in zip(opt.masters, twin_opt.masters):
        assert torch.equal(a, b)  # fp32 values, not the bf16 weights upcast
    assert twin_opt.state_dict()["inner"]["state"][0]["step"] == 1


def test_bf16_weights_train_with_fp32_masters_and_save_them(tmp_path):
    trainer = make_trainer(tmp_path, weights_dtype="bfloat16", beta=0.04)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in trainer.ref_model.parameters())
    assert trainer.model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers are left as loaded
    masters = trainer.master_weights.masters
    assert all(m.dtype == torch.float32 for m in masters)
    before = [m.detach().clone() for m in masters]
    result = trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, masters))
    saved = AutoModelForCausalLM.from_pretrained(result.model_dir)
    for (name, p), m in zip(saved.named_parameters(), masters):
        assert p.dtype == torch.float32 and torch.equal(p, m.detach()), name


def test_float32_weights_upcast_a_bf16_loaded_model(tmp_path):
    base, _ = load_model_and_tokenizer(SMALL.model_copy(update={"dtype": "bfloat16"}))
    trainer = make_trainer(tmp_path, model=base, beta=0.0)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


# -- 8-bit AdamW ---------------------------------------------------------------------------------------------------

def test_adamw_8bit_keeps_8bit_moments(tmp_path):
    pytest.importorskip("bitsandbytes")
    trainer = make_trainer(tmp_path, optimizer="adamw_8bit", beta=0.0)
    inner = trainer.optimizer.optimizer
    assert type(inner).__name__ == "AdamW8bit"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimise(_batch(trainer)[0])
    embed = trainer.model.get_input_embeddings().weight  # 1024 x 64: big enough for 8-bit state
    assert inner.state[embed]["state1"].dtype == torch.uint8
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("package, overrides", [("bitsandbytes", {"optimizer": "adamw_8bit"}),
                                                ("peft", {"lora": LoRAConfig()})])
def test_a_missing_extra_fails_before_any_work(tmp_path, monkeypatch, package, overrides):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ImportError, match=f"pip install {package}"):
        make_trainer(tmp_path, **overrides)


# -- LoRA ----------------------------------------------------------------------------------------------------------

def test_lora_trains_only_adapters_and_the_reference_is_the_base(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    base, _ = load_model_and_tokenizer(SMALL)
    original = copy.deepcopy(base)  # for comparing only; the trainer must make no copy of its own

    deepcopy = copy.deepcopy

    def no_model_copy(obj, *a, **k):
        assert not isinstance(obj, torch.nn.Module), "the trainer copied the model"
        return deepcopy(obj, *a, **k)

    monkeypatch.setattr(policy.copy, "deepcopy", no_model_copy)  # where the reference is made
    # the reference's log-probs are compared with the base model's to 1e-5: in fp32, whatever `auto` gives here
    trainer = make_trainer(tmp_path, model=base, lora=LoRAConfig(r=4, alpha=8), beta=0.04, max_steps=2,
                           mixed_precision="no")
    assert trainer.ref_model is None
    assert trainer.engine.sampler.unsupported_reason() is None  # the adapters sample through the static step
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.optimise(_batch(trainer)[0])

    batch, C = _batch(trainer)  # after an update: the policy has moved, the reference has not
    with torch.no_grad():
        base_logps, _ = token_logps(original, batch.input_ids, batch.attention_mask, C, 1.0)
        policy_logps, _ = token_logps(trainer.model, batch.input_ids, batch.attention_mask, C, 1.0)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(batch.ref_logps[mask], base_logps[mask], rtol=1e-5, atol=1e-5)
    assert (policy_logps[mask] - base_logps[mask]).abs().max() > 1e-4
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert any(not torch.equal(p, adapters[n]) for n, p in trainer.model.named_parameters() if n in adapters)

    trainer.cfg = trainer.cfg.model_copy(update={"max_steps": 1})
    result = trainer.train()
    merged = AutoModelForCausalLM.from_pretrained(result.model_dir)  # what the next stage loads
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    with torch.no_grad():
        merged_logps, _ = token_logps(merged, batch.input_ids, batch.attention_mask, C, 1.0)
        trained_logps, _ = token_logps(trainer.model, batch.input_ids, batch.attention_mask, C, 1.0)
    torch.testing.assert_close(merged_logps[mask], trained_logps[mask], rtol=1e-4, atol=1e-4)
