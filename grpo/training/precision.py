"""The precision a training loop runs in: the recipe's `mixed_precision`, resolved once against the hardware.

`auto` (every config's default) is bf16 where the device computes it natively and fp32 ("no") elsewhere:

- a CUDA GPU: bf16 where `torch.cuda.is_bf16_supported()` (Ampere and later), else fp32;
- a CPU: bf16 only with native bf16 instructions (AVX-512 BF16 or AMX in /proc/cpuinfo). Without them torch
  emulates every bf16 op, and bf16 autocast runs the tiny SFT step about 30x slower than fp32 (21.3 s against
  0.70 s on a 2-core AVX2 EPYC), where a CPU with them runs it 1.35x faster than fp32.

`R1_CPU_BF16=1` or `=0` overrides what the CPU check answers (to force bf16 or fp32 on a CPU, and for tests that
must run either way on any machine); a GPU's own answer is never overridden.

An explicit `bf16` is honoured everywhere, with a warning where it is emulated; `fp16` needs a CUDA GPU. The answer
("bf16", "fp16" or "no") goes to the Accelerator, and from it to the sampler, so one value decides both.

This module is the one place that resolves a precision: a stage resolves its config once (`resolve_config`), logs
the answer and why, keys its reuse and resume by it, and hands its loops the resolved value; pre-flight and the
Accelerator ask the same functions. `resolve_precision` is pure (the hardware is an argument, so tests inject it);
`this_machine` reads the hardware. Importing this module imports no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of CPUs that compute bf16
CPU_BF16_OVERRIDE = "R1_CPU_BF16"  # 1 or 0: what the CPU check answers, whatever the flags say


@dataclass(frozen=True)
class Hardware:
    """What decides the precision: the device the loop trains on and what it computes natively."""

    device: str  # "cuda" or "cpu": where the Accelerator puts the model
    cuda_bf16: bool = False  # the GPU computes bf16 (torch.cuda.is_bf16_supported())
    cpu_flags: frozenset[str] = frozenset()  # the CPU's feature flags (empty where they cannot be read)
    cpu_bf16_override: bool | None = None  # R1_CPU_BF16 where set: replaces the flags' answer on a CPU

    @property
    def native_bf16(self) -> bool:
        if self.device == "cuda":
            return self.cuda_bf16
        if self.cpu_bf16_override is not None:
            return self.cpu_bf16_override
        return bool(self.cpu_flags & NATIVE_BF16_CPU_FLAGS)

    def bf16_evidence(self) -> str:
        """Why native_bf16 says what it says: the override, the CPU flag found, or the GPU's own answer."""
        if self.device == "cuda":
            return f"torch.cuda.is_bf16_supported() is {self.cuda_bf16}"
        if self.cpu_bf16_override is not None:
            return f"{CPU_BF16_OVERRIDE}={int(self.cpu_bf16_override)} overrides the CPU check"
        found = sorted(self.cpu_flags & NATIVE_BF16_CPU_FLAGS)
        return f"CPU flag {', '.join(found)}" if found else "no avx512_bf16 or amx_bf16 CPU flag"

    def describe(self) -> str:
        if self.device == "cuda":
            return "a CUDA GPU" + ("" if self.cuda_bf16 else " without bf16 support")
        return "a CPU " + ("with native bf16" if self.native_bf16 else "without native bf16 (no avx512_bf16 or "
                                                                        "amx_bf16)")


def resolve_precision(requested: str, hw: Hardware) -> str:
    """`auto`, `bf16`, `fp16` or `no` -> the precision to train in on `hw`: "bf16", "fp16" or "no" (fp32).

    >>> resolve_precision("auto", Hardware("cpu", cpu_flags=frozenset({"avx2"})))
    'no'
    >>> resolve_precision("auto", Hardware("cpu", cpu_flags=frozenset({"avx512_bf16"})))
    'bf16'
    """
    if requested == "auto":
        return "bf16" if hw.native_bf16 else "no"
    if requested == "fp16" and hw.device != "cuda":
        raise ValueError("mixed_precision fp16 needs a CUDA GPU and this machine has none: use auto (bf16 where "
                         "the hardware computes it, else fp32), bf16 or no")
    if requested not in ("bf16", "fp16", "no"):
        raise ValueError(f"mixed_precision must be auto, bf16, fp16 or no, got {requested!r}")
    return requested


@dataclass(frozen=True)
class Resolved:
    """A training loop's precision and why: what the stage logs, and what its loops are handed."""

    requested: str  # the config's: auto, bf16, fp16 or no
    precision: str  # what it trains in: bf16, fp16 or no (fp32)
    reason: str  # e.g. "auto on a CPU: CPU flag avx512_bf16"


def resolve(requested: str, hw: Hardware | None = None) -> Resolved:
    """`requested` resolved on `hw` (default: this machine), with the reason.

    >>> resolve("auto", Hardware("cpu", cpu_flags=frozenset({"avx2"}), cpu_bf16_override=True)).reason
    'auto on a CPU: R1_CPU_BF16=1 overrides the CPU check'
    """
    hw = hw or this_machine()
    precision = resolve_precision(requested, hw)
    if requested != "auto":
        return Resolved(requested, precision, "asked for explicitly")
    where = "a CUDA GPU" if hw.device == "cuda" else "a CPU"
    return Resolved(requested, precision, f"auto on {where}: {hw.bf16_evidence()}")


def precision_fields(config: BaseModel, prefix: str = "") -> dict[str, str]:
    """Every `mixed_precision` field in a (nested) config, by dotted path: `{"grpo.memory.mixed_precision": "auto"}`.

    Found by walking the config, so a stage, pre-flight and reuse need no table of where its loops keep one.
    """
    found = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if name == "mixed_precision" and isinstance(value, str):
            found[prefix + name] = value
        elif isinstance(value, BaseModel):
            found.update(precision_fields(value, f"{prefix}{name}."))
    return found


def resolve_config(config: BaseModel, hw: Hardware | None = None) -> dict[str, Resolved]:
    """Every training loop's precision in `config`, resolved: `{"grpo.memory.mixed_precision": Resolved(...)}`."""
    fields = precision_fields(config)
    if not fields:
        return {}
    hw = hw or this_machine()
    return {path: resolve(requested, hw) for path, requested in fields.items()}


def emulated_bf16_warning(requested: str, hw: Hardware) -> str | None:
    """The warning for an explicit bf16 on a device that only emulates it; None when there is nothing to say."""
    if requested != "bf16" or hw.native_bf16:
        return None
    if hw.device == "cuda":
        return (f"mixed_precision bf16 on {hw.describe()}: it is emulated or refused there; use auto to train in "
                "fp32 on this GPU, or fp16")
    return (f"mixed_precision bf16 on {hw.describe()}: bf16 is emulated there and trains about 30x slower than fp32 "
            "(the tiny SFT step: 21.3 s against 0.70 s on an AVX2 CPU); use auto to train in fp32 on this machine")


def read_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of a /proc/cpuinfo text (its first `flags` line; every core lists the same)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, ARM
            return frozenset(value.split())
    return frozenset()


def this_machine() -> Hardware:
    """The hardware this process trains on (the Accelerator's choice: CUDA when available, else the CPU)."""
    import torch

    if torch.cuda.is_available():
        return Hardware("cuda", cuda_bf16=torch.cuda.is_bf16_supported())
    try:
        flags = read_cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: no flags to read, so no claim of native bf16
        flags = frozenset()
    return Hardware("cpu", cpu_flags=flags, cpu_bf16_override=cpu_bf16_override())


def cpu_bf16_override(environ=os.environ) -> bool | None:
    """`R1_CPU_BF16` read: True for 1, False for 0, None where unset or empty; anything else is refused."""
    value = environ.get(CPU_BF16_OVERRIDE, "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{CPU_BF16_OVERRIDE} must be 1 (the CPU computes bf16) or 0 (it does not), got {value!r}")
    return value == "1"


def choose_precision(requested: str, hw: Hardware | None = None) -> str:
    """`requested` resolved on `hw` (default: this machine): "bf16", "fp16" or "no"."""
    return resolve(requested, hw).precision
