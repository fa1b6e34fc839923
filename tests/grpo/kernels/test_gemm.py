"""fp32 linears on oneDNN or MKL (grpo.kernels.gemm): the private op still computes F.linear's products, the planned
linear's outputs and gradients equal F.linear's within fp32 rounding whichever library runs each GEMM, the plan
keeps a forced setting and measures under auto, a resumed loop goes on with the plan its checkpoint carries (on
the same CPU), and a GRPO run on oneDNN ends where the MKL run ends."""

import json
import shutil

import pandas as pd
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig, SFTConfig
from benchmarks.bytes_alive import BytesAlive
import grpo.kernels.gemm as gemm_module
from grpo.kernels.gemm import (KINDS, ONEDNN_MARGIN, PACKED_MEASURE_ELEMENTS, PLAN_FILE, PROBE_ELEMENTS, GemmPlan,
                               PlannedLinear, cpu_model, fp32_gemm, gemm_plan, load_plan, measure,
                               onednn_packed_problem, onednn_problem, pack_weight, packed_library, packed_product,
                               planned_linear, probe_shape)
from grpo.models import load_model_and_tokenizer
from grpo.training.checkpoints import CARRIED_FILES, write_manifest
from grpo.training.loops.grpo_trainer import GRPOTrainer
from grpo.training.loops.sft_trainer import train_sft
from tiny_configs import SMALL

ONEDNN = GemmPlan("onednn", "onednn", "onednn")
PACKERS = ["mkl"] + ([] if onednn_packed_problem() else ["onednn"])
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
    for fn in (lambda x, w, b: torch.nn.functional.linear(x, w, b), lambda x, w, b: planned_linear(x, w, b, plan)):
        xs, ws, bs = (t.clone().requires_grad_(True) if t is not None else None for t in (x, w, b))
        y = fn(xs, ws, bs)
        (y * torch.linspace(-1, 1, y.size(-1))).sum().backward()
        outs.append([y, xs.grad, ws.grad] + ([bs.grad] if bias else []))
    for name, want, got in zip(["output", "input grad", "weight grad", "bias grad"], *outs):
        assert got.shape == want.shape, name
        # both fp32 with different summation orders: relative rounding of a 24- to 120-term dot product
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)


def test_the_planned_linear_s_output_can_be_changed_in_place():
    # a logits hook masks tokens in place (`logits[..., ids] = -1e4`); an output made a view inside the autograd
    # Function could not be (main's precision pass failed so on a Zen 5 CPU, whose plan took oneDNN)
    w = torch.randn(19, 24, requires_grad=True)
    y = planned_linear(torch.randn(2, 3, 24), w, None, ONEDNN)  # [2, 3, 19]
    y[..., 0] = -1e4
    y.sum().backward()
    assert torch.equal(w.grad[0], torch.zeros(24)) and w.grad[1:].abs().sum() > 0  # the masked column has no gradient


def test_measuring_a_wide_head_costs_a_few_cut_operands_not_the_whole_gemm():
    # Qwen2.5's head at a micro-batch of 1,024 tokens: uncut, its output gradient alone is 1024 x 151936 x 4 bytes
    # (622 MB), and the probe peaked at 2.4 GB over the GRPO step it planned (the wide-vocabulary bench)
    wide = (1024, 896, 151936)
    assert probe_shape(*wide) == (1024, 896, PROBE_ELEMENTS // 1024)
    assert probe_shape(64, 256, 688) == (64, 256, 688)  # the tiny model's layers are measured whole
    with BytesAlive() as alive:
        rates = measure([wide], reps=1)
    assert alive.largest <= 4 * PROBE_ELEMENTS  # no operand past the cap (fp32: 4 bytes an element)
    assert alive.peak <= 4 * 4 * PROBE_ELEMENTS  # x, W, g and one product at a time
    assert sorted(rates) == sorted(f"{k}/{lib}" for k in KINDS for lib in ("mkl", "onednn"))
    assert all(rate > 0 for rate in rates.values())


def test_a_planned_output_head_still_gives_its_log_probs_chunk_by_chunk():
    # the plan's forward on the head made `selective_head` refuse it, so a CPU whose plan took oneDNN computed the
    # whole [N, C, V] logits: 6.2 GB against 1.75 GB for the wide-vocabulary GRPO bench on a Zen 5
    from grpo.training.logprobs import selective_head, token_logps

    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(ModelConfig(tiny=TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                         num_hidden_layers=1, num_attention_heads=2,
                                                                         num_key_value_heads=1)))
    model.float()
    ids = torch.randint(3, model.config.vocab_size, (4, 12))
    mask = torch.ones_like(ids)
    want, _ = token_logps(model, ids, mask, 8, 1.0)
    V = model.config.vocab_size
    with fp32_gemm(model, ONEDNN):
        assert selective_head(model) is model.lm_head
        with BytesAlive() as alive:  # chunks of 4 tokens, not the 32 x V logits
            got, _ = token_logps(model, ids, mask, 8, 1.0, plain_max_bytes=0, chunk_tokens=4)
    assert alive.largest < 4 * 8 * V * 4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_forced_setting_is_kept_and_auto_measures_each_gemm():
    assert gemm_plan("mkl", [(64, 32, 48)]) == GemmPlan(reason="fp32_gemm: mkl")
    forced = gemm_plan("onednn", [(64, 32, 48)])
    assert [getattr(forced, k) for k in KINDS] == ["onednn"] * 3 and not forced.rates
    auto = gemm_plan("auto", [(64, 32, 48), (64, 48, 32)])
    assert sorted(auto.rates) == sorted(f"{k}/{lib}" for k in KINDS for lib in ("mkl", "onednn"))
    for kind in KINDS:  # each GEMM on oneDNN only where it measured clearly faster
        faster = auto.rates[f"{kind}/onednn"] >= ONEDNN_MARGIN * auto.rates[f"{kind}/mkl"]
        assert getattr(auto, kind) == ("onednn" if faster else "mkl")
    assert auto.cpu == cpu_model() and "family" in cpu_model()  # the CPU it holds for
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
    """One fp32 GRPO step, every GEMM on oneDNN against every GEMM on MKL: the same samples, the same loss and the
    same gradients within fp32 rounding, and the same weights where the gradient is clear of rounding.

    What is compared is what does not depend on the summation order's rounding. Adam's first update is
    lr * g / (|g| + eps), about lr * sign(g): a gradient element that the GEMMs' order puts at +1e-9 on one library
    and -1e-9 on the other moves its weight by +lr and -lr. So weights after Adam steps differ by the learning
    rate's size wherever a gradient sits at rounding level, on one CPU and not another; the gradients themselves
    differ by rounding relative to their largest value, and that is what this test bounds."""
    torch.set_num_threads(1)  # one thread's kernels on either side: the comparison does not depend on the machine
    calls = []
    forward = PlannedLinear.forward
    monkeypatch.setattr(PlannedLinear, "forward", staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a)))
    prompts = pd.DataFrame({"prompt": [f"Count to {i}" for i in range(8)]})
    lr = 1e-2
    runs = {}
    for gemm in ("mkl", setting):
        model, tok = load_model_and_tokenizer(SMALL)
        names = {id(p): n for n, p in model.named_parameters()}
        cfg = GRPOConfig(max_steps=1, prompts_per_step=4, num_generations=4, micro_batch_size=8, beta=0.04,
                         learning_rate=lr, warmup_steps=0, rewards={"digits": 1.0}, mixed_precision="no",
                         checkpoint_every=0, log_every=1, fp32_gemm=gemm,
                         sampling=SamplingConfig(max_new_tokens=8, temperature=1.0))
        seen, grads = {}, {}

        def keep_gradients(optimizer, args, kwargs):  # what the optimizer is about to apply, by parameter name
            for group in optimizer.param_groups:
                grads.update({names[id(p)]: p.grad.detach().clone() for p in group["params"] if p.grad is not None})

        trainer = GRPOTrainer(model, tok, prompts, cfg, tmp_path / gemm, progress=False,
                              reward_functions={"digits": digits}, on_metrics=seen.__setitem__)
        calls.clear()
        hook = register_optimizer_step_pre_hook(keep_gradients)
        try:
            trainer.train()
        finally:
            hook.remove()
        runs[gemm] = (seen, grads, trainer.acc.unwrap_model(trainer.model).state_dict())
        assert (len(calls) > 0) == (gemm == "onednn")  # the policy's and the reference's linears went through it
        plan = json.loads((tmp_path / gemm / PLAN_FILE).read_text())
        assert [plan[k] for k in KINDS] == [gemm] * 3  # what the stage logs
    (a, ga, wa), (b, gb, wb) = runs["mkl"], runs[setting]
    assert b[1]["reward/total"] == a[1]["reward/total"]  # the same completions were sampled
    assert b[1]["train/loss"] == pytest.approx(a[1]["train/loss"], rel=1e-4, abs=1e-7)
    assert sorted(gb) == sorted(ga) and any(g.abs().max() > 0 for g in ga.values())
    for name, g in ga.items():
        scale = g.abs().max().item()
        # fp32 sums in another order: apart by a few units of rounding of the tensor's largest terms
        torch.testing.assert_close(gb[name], g, rtol=0, atol=1e-5 * scale + 1e-12, msg=f"gradient of {name}")
        # where the gradient is clear of rounding (above a thousandth of its largest value), Adam's step has one
        # sign and nearly one size on both libraries: the weights agree to a small share of the learning rate
        clear = g.abs() > 1e-3 * scale
        torch.testing.assert_close(wb[name][clear], wa[name][clear], rtol=0, atol=0.05 * lr, msg=name)


def test_a_loop_resumed_from_its_checkpoint_alone_goes_on_with_its_plan_on_the_same_cpu(tmp_path):
    """A stage resumed on a fresh disk gets only its durable checkpoint back: the plan it started with rides in
    it, so it goes on with the same kernels (a bit-equal resume); a plan measured on another CPU is measured again."""
    torch.set_num_threads(1)
    small = ModelConfig(tiny=TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
    rows = pd.DataFrame({"prompt": [f"What is {i} + 1?" for i in range(8)],
                         "response": [f"<answer>{i + 1}</answer>" for i in range(8)]})
    cfg = SFTConfig(max_steps=4, batch_size=4, learning_rate=1e-3, warmup_steps=0, log_every=1, checkpoint_every=2,
                    mixed_precision="no", fp32_gemm="auto")
    model, tok = load_model_and_tokenizer(small)

    def stop_at_3(step, _):
        if step == 3:
            raise KeyboardInterrupt  # after the step-2 checkpoint

    with pytest.raises(KeyboardInterrupt):
        train_sft(model, tok, rows, cfg, tmp_path / "first", stop_at_3, progress=False)
    assert PLAN_FILE in CARRIED_FILES
    made = load_plan(tmp_path / "first")
    assert made.setting == "auto" and made.rates and load_plan(tmp_path / "first" / "checkpoints" / "step-2") == made

    def resumed(cpu: str) -> GemmPlan:
        """Resume from step 2 in a fresh folder holding its checkpoint alone, as the durable store gives it back,
        with a plan that only this checkpoint could hold (measured on `cpu`)."""
        fresh = tmp_path / f"on-{len(cpu)}"
        step = fresh / "checkpoints" / "step-2"
        shutil.copytree(tmp_path / "first" / "checkpoints" / "step-2", step)
        held = made._replace(forward="onednn", input_grad="mkl", weight_grad="onednn", rates={"forward/mkl": 1.0},
                             cpu=cpu)
        held.save(step)
        write_manifest(step)  # a whole checkpoint, as it was written
        model, tok = load_model_and_tokenizer(small)
        train_sft(model, tok, rows, cfg, fresh, progress=False)
        return held, load_plan(fresh)

    held, plan = resumed(cpu_model())
    assert plan == held  # gone on with, not measured again
    held, plan = resumed("another CPU")
    assert plan.cpu == cpu_model() and plan.rates != held.rates  # measured here


@pytest.mark.parametrize("library", PACKERS)
def test_a_packed_weight_gives_the_fp64_product_at_the_rows_packed_for_and_at_fewer(library):
    # the sampler packs for its slots and runs its live rows, which fall to one as rows end
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(300, 48, generator=gen), torch.randn(300, generator=gen)
    packed = pack_weight(w, 16, library)
    for rows in (16, 5, 1):
        x = torch.randn(rows, 48, generator=gen)
        got = packed_product(x, packed, w, b, 16, library)  # [rows, 300]
        want = x.double() @ w.double().t() + b.double()
        assert got.shape == (rows, 300) and got.dtype == torch.float32
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-5


def test_the_sampler_s_packing_follows_the_setting_and_measures_only_large_weights(monkeypatch):
    timed = []
    real = gemm_module.measure_packed
    monkeypatch.setattr(gemm_module, "measure_packed", lambda *a: timed.append(a) or real(*a))
    gemm_module._packed_library.cache_clear()
    try:
        assert packed_library("mkl", 32, 256, 151936) == "mkl" and not timed  # MKL's packing, as before: no timing
        assert packed_library("auto", 32, 64, 96) == "mkl" and not timed  # 6,144 elements: a few microseconds a call
        if "onednn" in PACKERS:
            assert packed_library("onednn", 32, 64, 96) == "onednn" and not timed
            wide = packed_library("auto", 8, 256, PACKED_MEASURE_ELEMENTS // 256)  # timed, once a process a shape
            assert wide in ("mkl", "onednn") and timed == [(8, 256, PACKED_MEASURE_ELEMENTS // 256)]
            assert packed_library("auto", 8, 256, PACKED_MEASURE_ELEMENTS // 256) == wide and len(timed) == 1
        with pytest.raises(ValueError, match="auto, mkl or onednn"):
            packed_library("fastest", 32, 64, 96)
    finally:
        gemm_module._packed_library.cache_clear()
