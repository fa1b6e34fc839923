"""fp32 linears on oneDNN or MKL (grpo.kernels.gemm): the private op still computes F.linear's products, the planned
linear's outputs and gradients equal F.linear's within fp32 rounding whichever library runs each GEMM, the plan
keeps a forced setting and measures under auto, and a GRPO run on oneDNN ends where the MKL run ends."""

import json

import pandas as pd
import pytest
import torch

from grpo.config import GRPOConfig, ModelConfig, SamplingConfig, TinyModelConfig
from grpo.kernels.gemm import KINDS, PLAN_FILE, GemmPlan, PlannedLinear, fp32_gemm, gemm_plan, onednn_problem
from grpo.models import load_model_and_tokenizer
from grpo.training.grpo_trainer import GRPOTrainer

ONEDNN = GemmPlan("onednn", "onednn", "onednn")
MIXED = GemmPlan("onednn", "mkl", "onednn")


def test_the_private_op_still_gives_f_linear_products():
    """torch.ops.mkldnn._linear_pointwise is private: a torch that drops or changes it must fail here, loudly,
    not leave `auto` quietly on MKL (it would fall back, with this reason in the stage's parameters)."""
    assert onednn_problem() is None


@pytest.mark.parametrize("plan", [ONEDNN, MIXED], ids=["onednn", "mixed"])
@pytest.mark.parametrize("shape, bias, strided", [((2, 37, 24), True, False), ((45, 24), False, False),
                                                  ((3, 11, 24), True, True)])
def test_the_planned_linear_equals_f_linear_within_fp32_rounding(plan, shape, bias, strided):
    torch.manual_seed(0)
    x = torch.randn(*shape[:-1], shape[-1] + 5)[..., 5:] if strided else torch.randn(shape)  # a strided view
    w, b = torch.randn(19, 24), torch.randn(19) if bias else None
    outs = []
    for fn in (lambda x, w, b: torch.nn.functional.linear(x, w, b), lambda x, w, b: PlannedLinear.apply(x, w, b, plan)):
        xs, ws, bs = (t.clone().requires_grad_(True) if t is not None else None for t in (x, w, b))
        y = fn(xs, ws, bs)
        (y * torch.linspace(-1, 1, y.size(-1))).sum().backward()
        outs.append([y, xs.grad, ws.grad] + ([bs.grad] if bias else []))
    for name, want, got in zip(["output", "input grad", "weight grad", "bias grad"], *outs):
        assert got.shape == want.shape, name
        # both fp32 with different summation orders: relative rounding of a 24- to 120-term dot product
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)


def test_a_forced_setting_is_kept_and_auto_measures_each_gemm():
    assert gemm_plan("mkl", [(64, 32, 48)]) == GemmPlan(reason="fp32_gemm: mkl")
    forced = gemm_plan("onednn", [(64, 32, 48)])
    assert [getattr(forced, k) for k in KINDS] == ["onednn"] * 3 and not forced.rates
    auto = gemm_plan("auto", [(64, 32, 48), (64, 48, 32)])
    assert sorted(auto.rates) == sorted(f"{k}/{lib}" for k in KINDS for lib in ("mkl", "onednn"))
    for kind in KINDS:  # each GEMM on the library that measured faster
        pick = getattr(auto, kind)
        assert auto.rates[f"{kind}/{pick}"] == max(auto.rates[f"{kind}/mkl"], auto.rates[f"{kind}/onednn"])
    params = auto.params("grpo")
    assert params["grpo.fp32_gemm.forward"] == auto.forward and "grpo.fp32_gemm.gflops.forward/mkl" in params
    with pytest.raises(ValueError, match="fp32_gemm must be auto, mkl or onednn"):
        gemm_plan("blas", [])


def test_only_plain_fp32_linears_are_planned_and_their_forward_comes_back():
    model, _ = load_model_and_tokenizer(ModelConfig(tiny=TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                         num_hidden_layers=1, num_attention_heads=2,
                                                                         num_key_value_heads=1)))
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with fp32_gemm(model, ONEDNN):
        assert all("forward" in vars(m) for m in linears)
        during = model(ids).logits
    assert not any("forward" in vars(m) for m in linears)
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-5)
    with fp32_gemm(model, GemmPlan()):  # MKL throughout: torch's own path, nothing patched
        assert not any("forward" in vars(m) for m in linears)
    model.to(torch.bfloat16)
    with fp32_gemm(model, ONEDNN):  # bf16 weights are autocast's and oneDNN's already
        assert not any("forward" in vars(m) for m in linears)


def digits(completions, **_):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


@pytest.mark.parametrize("setting", ["onednn"])
def test_a_grpo_run_on_onednn_ends_where_the_mkl_run_ends(tmp_path, setting, monkeypatch):
    """Three fp32 GRPO steps, every GEMM on oneDNN against every GEMM on MKL: the same samples and the same
    weights within the two-process test's tolerance (float32 rounding of other summation orders, through Adam)."""
    torch.set_num_threads(1)  # one thread's kernels on either side: the comparison does not depend on the machine
    calls = []
    forward = PlannedLinear.forward
    monkeypatch.setattr(PlannedLinear, "forward", staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a)))
    small = ModelConfig(tiny=TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1))
    prompts = pd.DataFrame({"prompt": [f"Count to {i}" for i in range(8)]})
    runs = {}
    for gemm in ("mkl", setting):
        model, tok = load_model_and_tokenizer(small)
        cfg = GRPOConfig(max_steps=3, prompts_per_step=4, num_generations=4, micro_batch_size=8, beta=0.04,
                         learning_rate=1e-2, warmup_steps=0, rewards={"digits": 1.0}, mixed_precision="no",
                         checkpoint_every=0, log_every=1, fp32_gemm=gemm,
                         sampling=SamplingConfig(max_new_tokens=8, temperature=1.0))
        seen = {}
        trainer = GRPOTrainer(model, tok, prompts, cfg, tmp_path / gemm, progress=False,
                              reward_functions={"digits": digits}, on_metrics=seen.__setitem__)
        calls.clear()
        trainer.train()
        runs[gemm] = (seen, trainer.acc.unwrap_model(trainer.model).state_dict())
        assert (len(calls) > 0) == (gemm == "onednn")  # the policy's and the reference's linears went through it
        plan = json.loads((tmp_path / gemm / PLAN_FILE).read_text())
        assert [plan[k] for k in KINDS] == [gemm] * 3  # what the stage logs
    (a, wa), (b, wb) = runs["mkl"], runs[setting]
    for step in (1, 2, 3):
        assert b[step]["reward/total"] == a[step]["reward/total"]  # the same completions were sampled
        assert b[step]["train/loss"] == pytest.approx(a[step]["train/loss"], rel=1e-4, abs=1e-7)
    for name, p in wa.items():
        torch.testing.assert_close(wb[name], p, rtol=0, atol=5e-4, msg=name)
