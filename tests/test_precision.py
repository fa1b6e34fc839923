"""Precision follows the hardware: the resolver with the hardware injected, the recipe's spellings, the loops' use."""

import warnings

import pytest
import yaml

from grpo.config import GRPOConfig, SFTConfig
from grpo.recipe import RecipeError, load_recipe
from grpo.training.precision import (
    Hardware,
    choose_precision,
    emulated_bf16_warning,
    read_cpu_flags,
    resolve_precision,
    this_machine,
)

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
    assert recipe.reasoning_grpo.grpo.mixed_precision == read


def test_an_unknown_precision_names_the_field_and_the_choices(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"sft": {"train": {"mixed_precision": "bf61"}}}))
    with pytest.raises(RecipeError, match=r"sft\.train\.mixed_precision: Input should be 'auto', 'bf16', 'fp16' "
                                          r"or 'no' \(got 'bf61'\)"):
        load_recipe(path)


def test_every_default_and_the_tiny_recipe_say_auto():
    assert SFTConfig().mixed_precision == GRPOConfig().mixed_precision == "auto"
    tiny = load_recipe("tiny")
    assert tiny.cold_start_sft.train.mixed_precision == tiny.sft.train.mixed_precision == "auto"
    assert tiny.reasoning_grpo.grpo.mixed_precision == tiny.alignment_grpo.reward_model.mixed_precision == "auto"


def test_the_accelerator_trains_in_the_resolved_precision():
    from grpo.training.accelerator import make_accelerator

    assert make_accelerator("auto").mixed_precision == choose_precision("auto", this_machine())
    assert make_accelerator("no").mixed_precision == "no"


@pytest.mark.skipif(this_machine().native_bf16, reason="this machine computes bf16 natively: nothing to warn")
def test_explicit_bf16_on_an_emulating_machine_runs_and_warns():
    from grpo.training.accelerator import make_accelerator

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert make_accelerator("bf16").mixed_precision == "bf16"
    assert [str(w.message) for w in caught if "30x slower" in str(w.message) or "emulated" in str(w.message)]
