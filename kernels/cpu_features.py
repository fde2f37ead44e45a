"""What the host CPU computes natively, and the CPU dtype that follows: bfloat16 where the CPU has bf16
instructions (x86 avx512_bf16 or AMX, Arm bf16), float32 elsewhere.

On a CPU with native bf16 the bench model's layer projections run about twice as fast in bfloat16 as
in float32 (bench/lora_cpu_kernels.py, base_us column, on an AMD EPYC with avx512_bf16, one thread);
without it torch emulates bf16 and float32 is both faster and exact.

    default_cpu_dtype()   torch.bfloat16 or torch.float32, for EngineConfig's dtype="auto" on CPU
    cpu_dtype_reason()    e.g. "bfloat16: the CPU has native bf16 (avx512_bf16)", for the start-up log

An operator (or a test suite whose references are float32) pins the CPU default for a whole process tree
with LORAPLEX_CPU_DTYPE=float32|bfloat16; an explicit --dtype still wins over both.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
CPU_DTYPE_ENV = "LORAPLEX_CPU_DTYPE"
PINNABLE = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Flags that mean bf16 arithmetic in hardware: x86 AVX512-BF16 / AMX-BF16 (Linux names), Arm FEAT_BF16.
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FLAGS = ("bf16",)


@dataclass(frozen=True)
class CpuBf16Support:
    """Whether the CPU has native bf16, and the evidence: the flags found and where they came from."""

    native: bool
    flags: tuple[str, ...]  # the bf16 flags present, e.g. ("avx512_bf16",)
    source: str  # "/proc/cpuinfo", "torch" (no cpuinfo: torch's own CPU probe) or "none"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.native else torch.float32

    @property
    def reason(self) -> str:
        if self.native:
            return f"bfloat16: the CPU has native bf16 ({', '.join(self.flags)})"
        if self.source == "none":
            return "float32: could not read the CPU's features, so bf16 is not assumed"
        return "float32: the CPU has no native bf16 (no avx512_bf16, amx_bf16 or Arm bf16), torch would emulate it"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of /proc/cpuinfo text: x86 "flags" lines, Arm "Features" lines (all CPUs)."""
    found: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            found.update(value.split())
    return frozenset(found)


def bf16_support(cpuinfo: str | None = None, machine: str | None = None) -> CpuBf16Support:
    """Detect native bf16 from /proc/cpuinfo (or the text given), else from torch's CPU probe.

    Reads /proc/cpuinfo once per call; pass `cpuinfo` and `machine` (platform.machine()) to decide for
    another CPU, as the tests do.
    """
    machine = (machine or platform.machine()).lower()
    wanted = ARM_BF16_FLAGS if machine in ("aarch64", "arm64") else X86_BF16_FLAGS
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return _torch_probe()
    present = tuple(flag for flag in wanted if flag in cpu_flags(cpuinfo))
    return CpuBf16Support(bool(present), present, "/proc/cpuinfo")


def pinned_cpu_dtype() -> torch.dtype | None:
    """The dtype LORAPLEX_CPU_DTYPE pins, or None; an unknown value is an error, not a silent default."""
    value = os.environ.get(CPU_DTYPE_ENV, "").strip()
    if not value:
        return None
    if value not in PINNABLE:
        raise ValueError(f"{CPU_DTYPE_ENV} must be one of {', '.join(PINNABLE)}, got {value!r}")
    return PINNABLE[value]


def default_cpu_dtype() -> torch.dtype:
    """The dtype a CPU engine should default to: bfloat16 with native bf16, float32 elsewhere."""
    pinned = pinned_cpu_dtype()
    return pinned if pinned is not None else bf16_support().dtype


def cpu_dtype_reason() -> str:
    """One line for the start-up log: the default CPU dtype and why."""
    pinned = pinned_cpu_dtype()
    if pinned is not None:
        return f"{str(pinned).removeprefix('torch.')}: pinned by {CPU_DTYPE_ENV}"
    return bf16_support().reason


def _torch_probe() -> CpuBf16Support:
    """No /proc/cpuinfo (macOS, Windows): ask torch's private CPU probe, when this torch has one."""
    probes: Iterable[tuple[str, str]] = (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported"))
    found = []
    for flag, name in probes:
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                found.append(flag)
        except RuntimeError:
            continue
    if not any(getattr(torch.cpu, name, None) for _, name in probes):
        return CpuBf16Support(False, (), "none")
    return CpuBf16Support(bool(found), tuple(found), "torch")
