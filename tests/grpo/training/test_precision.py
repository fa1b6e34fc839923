"""Precision follows the hardware: the resolver with the hardware injected, the recipe's spellings, the loops' use."""

import warnings

import pytest
import torch
import yaml

from grpo.configs.recipe import RecipeError, load_recipe
from grpo.configs.training import GRPOConfig, SFTConfig
from grpo.training.precision import (
    Hardware,
    Resolved,
    cpu_bf16_override,
    emulated_bf16_warning,
    precision_fields,
    read_cpu_flags,
    resolve,
    resolve_config,
    resolve_precision,
)

pytestmark = pytest.mark.precision

AVX2_CPU = Hardware("cpu", cpu_flags=frozenset({"sse4_2", "avx", "avx2", "fma"}))  # CI's EPYC: no bf16 instructions
AVX512_BF16_CPU = Hardware("cpu", cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"}))  # Cooper Lake, Zen 4
AMX_CPU = Hardware("cpu", cpu_flags=frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"}))  # Sapphire Rapids
AMPERE = Hardware("cuda", cuda_bf16=True)
TURING = Hardware("cuda", cuda_bf16=False)


@pytest.mark.parametrize("hw, expected", [(AVX2_CPU, "no"), (AVX512_BF16_CPU, "bf16"), (AMX_CPU, "bf16"),
                                          (AMPERE, "bf16"), (TURING, "no"), (Hardware("cpu"), "no")])
def test_auto_is_bf16_only_where_the_device_computes_it_natively(hw, expected):
    assert resolve_precision("auto", hw) == expected


@pytest.mark.parametrize("hw", [AVX2_CPU, AMX_CPU, AMPERE, TURING])
def test_an_explicit_choice_is_kept(hw):
    assert resolve_precision("bf16", hw) == "bf16"
    assert resolve_precision("no", hw) == "no"


def test_fp16_needs_a_gpu():
    assert resolve_precision("fp16", AMPERE) == "fp16"
    with pytest.raises(ValueError, match="fp16 needs a CUDA GPU"):
        resolve_precision("fp16", AMX_CPU)


def test_explicit_bf16_warns_only_where_it_is_emulated():
    message = emulated_bf16_warning("bf16", AVX2_CPU)
    assert "30x slower" in message and "auto" in message
    assert emulated_bf16_warning("bf16", AMX_CPU) is None
    assert emulated_bf16_warning("bf16", AMPERE) is None
    assert emulated_bf16_warning("auto", AVX2_CPU) is None  # auto never picks the slow path: nothing to warn
    assert "emulated" in emulated_bf16_warning("bf16", TURING)


def test_cpu_flags_are_read_from_cpuinfo():
    cpuinfo = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512_bf16\n\n"
               "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512_bf16\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2", "avx512_bf16"}
    assert read_cpu_flags("processor : 0\n") == frozenset()


@pytest.mark.parametrize("written, read", [("auto", "auto"), ("bf16", "bf16"), ("no", "no"), ("'no'", "no"),
                                           ("fp32", "no"), ("false", "no")])
def test_recipe_spellings(tmp_path, written, read):
    # a bare `no` is YAML's false: it means no mixed precision, as the user meant
    path = tmp_path / "r.yaml"
    path.write_text(f"cold_start_sft:\n  train:\n    mixed_precision: {written}\n"
                    f"reasoning_grpo:\n  grpo:\n    mixed_precision: {written}\n")
    recipe = load_recipe(path)
    assert recipe.cold_start_sft.train.mixed_precision == read
    assert recipe.reasoning_grpo.grpo.memory.mixed_precision == read


def test_an_unknown_precision_names_the_field_and_the_choices(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"sft": {"train": {"mixed_precision": "bf61"}}}))
    with pytest.raises(RecipeError, match=r"sft\.train\.mixed_precision: Input should be 'auto', 'bf16', 'fp16' "
                                          r"or 'no' \(got 'bf61'\)"):
        load_recipe(path)


def test_every_default_and_the_tiny_recipe_say_auto():
    assert SFTConfig().mixed_precision == GRPOConfig().memory.mixed_precision == "auto"
    tiny = load_recipe("tiny")
    assert tiny.cold_start_sft.train.mixed_precision == tiny.sft.train.mixed_precision == "auto"
    assert tiny.reasoning_grpo.grpo.memory.mixed_precision == tiny.alignment_grpo.reward_model.mixed_precision == "auto"


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="R1_CPU_BF16 speaks for a CPU; this machine trains "
                                                                "on its GPU")


@CPU_ONLY
@pytest.mark.parametrize("override, expected", [("1", "bf16"), ("0", "no")])
def test_the_accelerator_trains_in_the_resolved_precision(monkeypatch, override, expected):
    from grpo.training.accelerator import make_accelerator

    monkeypatch.setenv("R1_CPU_BF16", override)  # the CPU's answer given, whatever this machine's flags say
    assert make_accelerator("auto").mixed_precision == expected
    assert make_accelerator("no").mixed_precision == "no"


@CPU_ONLY
def test_explicit_bf16_on_an_emulating_machine_runs_and_warns(monkeypatch):
    from grpo.training.accelerator import make_accelerator

    monkeypatch.setenv("R1_CPU_BF16", "0")  # a CPU without bf16 instructions, on any machine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert make_accelerator("bf16").mixed_precision == "bf16"
    assert [str(w.message) for w in caught if "30x slower" in str(w.message) or "emulated" in str(w.message)]


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("", None), (None, None)])
def test_r1_cpu_bf16_overrides_the_cpu_check_and_says_so(value, expected):
    environ = {} if value is None else {"R1_CPU_BF16": value}
    assert cpu_bf16_override(environ) is expected
    hw = Hardware("cpu", cpu_flags=AVX2_CPU.cpu_flags, cpu_bf16_override=expected)
    resolved = resolve("auto", hw)
    assert resolved.precision == ("bf16" if expected else "no")
    assert resolved.reason == ("auto on a CPU: R1_CPU_BF16=1 overrides the CPU check" if expected else
                               "auto on a CPU: R1_CPU_BF16=0 overrides the CPU check" if expected is False else
                               "auto on a CPU: no avx512_bf16 or amx_bf16 CPU flag")
    # a GPU answers for itself
    assert resolve("auto", Hardware("cuda", cuda_bf16=True, cpu_bf16_override=False)).precision == "bf16"


def test_the_reason_names_the_cpu_flag_found_or_the_explicit_choice():
    assert resolve("auto", AMX_CPU).reason == "auto on a CPU: CPU flag amx_bf16"
    assert resolve("auto", AVX512_BF16_CPU).reason == "auto on a CPU: CPU flag avx512_bf16"
    assert resolve("no", AMX_CPU) == Resolved("no", "no", "asked for explicitly")


def test_a_bad_override_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"R1_CPU_BF16 must be 1 .* or 0 .*, got 'yes'"):
        cpu_bf16_override({"R1_CPU_BF16": "yes"})


def test_every_training_loop_of_a_stage_is_found_in_its_config():
    from grpo.configs.recipe import load_recipe

    tiny = load_recipe("tiny")
    assert precision_fields(tiny.alignment_grpo) == {"reward_model.mixed_precision": "auto",
                                                     "grpo.memory.mixed_precision": "auto",
                                                     "dpo.mixed_precision": "auto"}  # algorithm: dpo's loop
    assert precision_fields(tiny.cold_start_sft) == {"train.mixed_precision": "auto"}
    assert precision_fields(tiny.rejection_sampling) == {}  # samples only: no training loop
    resolved = resolve_config(tiny.alignment_grpo, AVX2_CPU)
    assert {path: r.precision for path, r in resolved.items()} == {"reward_model.mixed_precision": "no",
                                                                    "grpo.memory.mixed_precision": "no",
                                                                    "dpo.mixed_precision": "no"}


@CPU_ONLY
def test_reuse_is_keyed_by_the_precision_auto_resolves_to(monkeypatch):
    """Work trained in bf16 is not what an fp32 run would make: the stage key differs, unless the recipe pins one."""
    from grpo.configs.recipe import load_recipe
    from runtime.reuse import stage_key

    cfg = load_recipe("tiny").cold_start_sft
    keys = {}
    for override in ("0", "1"):
        monkeypatch.setenv("R1_CPU_BF16", override)
        keys[override] = stage_key("cold_start_sft", cfg, {})
    assert keys["0"] != keys["1"]
    pinned = cfg.model_copy(update={"train": cfg.train.model_copy(update={"mixed_precision": "no"})})
    pinned_keys = set()
    for override in ("0", "1"):
        monkeypatch.setenv("R1_CPU_BF16", override)
        pinned_keys.add(stage_key("cold_start_sft", pinned, {}))
    assert len(pinned_keys) == 1
