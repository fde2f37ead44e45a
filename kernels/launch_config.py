"""Launch configurations of the Triton kernels, and what an ahead-of-time compile of each variant needs.

A Triton kernel compiles once per set of tl.constexpr values and launch options. Each kernel module picks
its launch configuration from tables it exports (`lora_triton.SHRINK_CONFIGS`, `attention_triton.
DECODE_CONFIGS`, ...) and lists, with `compile_variants()`, every variant its dispatch can launch: each table
entry in each data dtype. `kernels.triton_aot` compiles that list for sm_80 and sm_90 without a GPU
(tests/kernels/test_triton_compile.py runs it), so a configuration that fails to compile, spills registers
or needs more shared memory than the target has cannot reach a launch unseen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Triton's name of each data dtype a kernel is launched with -> the torch dtype.
DATA_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

Constexpr = int | bool | float


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes (the kernel's BLOCK_* constexprs) and launch options of one Triton launch.

    `launch_kwargs()` is what the dispatch passes, so a launch and its compiled variant cannot drift apart.
    FP fusion (FMA contraction) is set explicitly: Triton 3.9 warns when it is left to the default, and
    3.10 changes that default.
    """

    blocks: tuple[tuple[str, int], ...]  # (("BLOCK_M", 16), ("BLOCK_R", 32), ...)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        if not all(name.startswith("BLOCK_") and size > 0 for name, size in self.blocks):
            raise ValueError(f"blocks must be positive BLOCK_* sizes, got {self.blocks}")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad launch options: num_warps={self.num_warps}, num_stages={self.num_stages}")

    @classmethod
    def of(cls, num_warps: int = 4, num_stages: int = 3, **blocks: int) -> LaunchConfig:
        return cls(tuple(sorted(blocks.items())), num_warps, num_stages)

    def __getitem__(self, name: str) -> int:
        return dict(self.blocks)[name]

    def launch_kwargs(self) -> dict[str, Any]:
        return {**dict(self.blocks), "num_warps": self.num_warps, "num_stages": self.num_stages,
                "enable_fp_fusion": True}

    @property
    def label(self) -> str:
        tiles = " ".join(f"{name.removeprefix('BLOCK_')}={size}" for name, size in self.blocks)
        return f"{tiles} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class KernelVariant:
    """One compile of a kernel: its argument types, every constexpr value, and the launch options."""

    kernel: Any  # the @triton.jit function (a triton.runtime.JITFunction when not interpreted)
    dtype: str  # key of DATA_DTYPES: the dtype of the launch's data tensors
    config: LaunchConfig
    flags: tuple[tuple[str, Constexpr], ...]  # the other constexprs (DOT_FP32, GROUP, HEAD_DIM, ...)
    signature: tuple[tuple[str, str], ...]  # (argument, Triton type) for every argument, in order
    # "default": compiled by the default test suite; "full": only by the full sweep (python -m
    # kernels.triton_aot), for variants that repeat a default one's launch config under another model flag
    tier: str = "default"

    @property
    def name(self) -> str:
        return self.kernel.__name__

    @property
    def constexprs(self) -> dict[str, Constexpr]:
        return {**dict(self.flags), **dict(self.config.blocks)}

    @property
    def label(self) -> str:
        flags = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.flags)
        return f"{self.config.label} | {flags}"


def variant(
    kernel: Any,
    dtype: str,
    config: LaunchConfig,
    flags: Mapping[str, Constexpr],
    data_pointers: Iterable[str],
    fp32_pointers: Iterable[str] = (),
    fp32_scalars: Iterable[str] = (),
    tier: str = "default",
) -> KernelVariant:
    """Describe one compile of `kernel`. Pointers not named are int32 tensors; scalars not named int32.

    Raises ValueError when the constexprs given (flags and config blocks) are not exactly the kernel's,
    or a named argument does not exist, so a kernel that gains an argument breaks its variant list loudly.
    """
    if dtype not in DATA_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DATA_DTYPES)}, got {dtype!r}")
    params = kernel.params
    names = [p.name for p in params]
    constexprs = {**flags, **dict(config.blocks)}
    expected = {p.name for p in params if p.is_constexpr}
    if set(constexprs) != expected or len(constexprs) != len(flags) + len(config.blocks):
        raise ValueError(f"{kernel.__name__}: constexprs {sorted(constexprs)} do not match {sorted(expected)}")
    data, fp32, scalars = set(data_pointers), set(fp32_pointers), set(fp32_scalars)
    if unknown := (data | fp32 | scalars) - set(names):
        raise ValueError(f"{kernel.__name__} has no arguments {sorted(unknown)}")

    def arg_type(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in data:
            return f"*{dtype}"
        if name in fp32:
            return "*fp32"
        if name.endswith("_ptr"):
            return "*i32"
        return "fp32" if name in scalars else "i32"

    if tier not in ("default", "full"):
        raise ValueError(f"tier must be 'default' or 'full', got {tier!r}")
    return KernelVariant(kernel, dtype, config, tuple(flags.items()), tuple((n, arg_type(n)) for n in names), tier)
