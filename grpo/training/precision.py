"""The precision a training loop runs in: the recipe's `mixed_precision`, resolved once against the hardware.

`auto` (every config's default) is bf16 where the device computes it natively and fp32 ("no") elsewhere:

- a CUDA GPU: bf16 where `torch.cuda.is_bf16_supported()` (Ampere and later), else fp32;
- a CPU: bf16 only with native bf16 instructions (AVX-512 BF16 or AMX in /proc/cpuinfo). Without them torch
  emulates every bf16 op, and bf16 autocast runs the tiny SFT step about 30x slower than fp32 (21.3 s against
  0.70 s on a 2-core AVX2 EPYC), where a CPU with them runs it 1.35x faster than fp32.

An explicit `bf16` is honoured everywhere, with a warning where it is emulated; `fp16` needs a CUDA GPU. The answer
("bf16", "fp16" or "no") goes to the Accelerator, and from it to the sampler, so one value decides both.

`resolve_precision` is pure (the hardware is an argument, so tests inject it); `this_machine` reads the hardware.
Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of CPUs that compute bf16


@dataclass(frozen=True)
class Hardware:
    """What decides the precision: the device the loop trains on and what it computes natively."""

    device: str  # "cuda" or "cpu": where the Accelerator puts the model
    cuda_bf16: bool = False  # the GPU computes bf16 (torch.cuda.is_bf16_supported())
    cpu_flags: frozenset[str] = frozenset()  # the CPU's feature flags (empty where they cannot be read)

    @property
    def native_bf16(self) -> bool:
        return self.cuda_bf16 if self.device == "cuda" else bool(self.cpu_flags & NATIVE_BF16_CPU_FLAGS)

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
    return Hardware("cpu", cpu_flags=flags)


def choose_precision(requested: str, hw: Hardware | None = None) -> str:
    """`requested` resolved on `hw` (default: this machine)."""
    return resolve_precision(requested, hw or this_machine())
