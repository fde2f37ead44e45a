"""Native bf16 detection from /proc/cpuinfo text, and the default CPU dtype that follows."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_features
from kernels.cpu_features import bf16_support, cpu_dtype_reason, cpu_flags, default_cpu_dtype

ZEN4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_fp16 amx_bf16 amx_tile amx_int8\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512_vnni avx512_vbmi2\n"  # AVX-512, no bf16
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm svebf16\nCPU implementer\t: 0x41\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp\n"


def test_flags_come_from_flags_and_features_lines() -> None:
    assert {"avx512_bf16", "avx2"} <= cpu_flags(ZEN4)
    assert "bf16" in cpu_flags(GRAVITON3)
    assert not cpu_flags("model name\t: bf16 in a name is not a flag\n")


def test_native_bf16_on_x86_and_arm() -> None:
    for text, machine, flags in ((ZEN4, "x86_64", ("avx512_bf16",)), (SAPPHIRE_RAPIDS, "x86_64", ("amx_bf16",)),
                                 (GRAVITON3, "aarch64", ("bf16",))):
        support = bf16_support(text, machine)
        assert support.native and support.flags == flags and support.dtype == torch.bfloat16
        assert support.reason.startswith("bfloat16:") and flags[0] in support.reason


def test_float32_without_native_bf16() -> None:
    for text, machine in ((ICE_LAKE, "x86_64"), (GRAVITON2, "aarch64"), (GRAVITON3, "x86_64")):
        support = bf16_support(text, machine)  # an Arm "bf16" flag means nothing on x86, and vice versa
        assert not support.native and support.dtype == torch.float32 and support.reason.startswith("float32:")


def test_this_machine_gets_a_dtype_and_a_reason() -> None:
    assert default_cpu_dtype() in (torch.float32, torch.bfloat16)
    assert cpu_dtype_reason().split(":")[0] == str(default_cpu_dtype()).removeprefix("torch.")


def test_engine_auto_dtype_on_cpu_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from engine.config import EngineConfig
    from wire.checkpoint import ModelConfig

    monkeypatch.delenv(cpu_features.CPU_DTYPE_ENV, raising=False)
    model = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
                                   "intermediate_size": 16, "vocab_size": 32, "torch_dtype": "float32"})
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu_features, "CPUINFO", cpuinfo)
    monkeypatch.setattr(cpu_features.platform, "machine", lambda: "x86_64")
    cpuinfo.write_text("flags\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert EngineConfig(model="unused").torch_dtype(model) is torch.bfloat16
    assert "avx512_bf16" in EngineConfig(model="unused").dtype_reason(model)
    cpuinfo.write_text("flags\t: fpu sse2 avx2\n")
    assert EngineConfig(model="unused").torch_dtype(model) is torch.float32
    # an explicit dtype wins; quantized weights take bf16 activations, except int8, w8a8, int4 and w4a8 on a
    # CPU without native bf16 whose native kernels read float32 (AVX2 builds)
    assert EngineConfig(model="unused", dtype="float32").dtype_reason(model) == "float32: set by dtype=float32"
    from kernels import native_cpu

    ops = native_cpu.ops()
    for method, has_f32 in (("int8", "has_int8_linear_f32"), ("w8a8", "has_w8a8_linear_f32"),
                            ("int4", "has_int4_linear_f32"), ("w4a8", "has_w4a8_linear")):
        want = torch.float32 if ops is not None and getattr(ops, has_f32)() else torch.bfloat16
        config = EngineConfig(model="unused", quantization=method)
        assert config.torch_dtype(model) is want
        assert config.dtype_reason(model).startswith(str(want).removeprefix("torch.") + ":")
    cpuinfo.write_text("flags\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    for method in ("w8a8", "int4", "w4a8"):
        assert EngineConfig(model="unused", quantization=method).torch_dtype(model) is torch.bfloat16


def test_the_cpu_default_can_be_pinned_for_a_process_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_features.CPU_DTYPE_ENV, "bfloat16")
    assert default_cpu_dtype() is torch.bfloat16
    assert cpu_dtype_reason() == "bfloat16: pinned by LORAPLEX_CPU_DTYPE"
    monkeypatch.setenv(cpu_features.CPU_DTYPE_ENV, "float32")
    assert default_cpu_dtype() is torch.float32
    monkeypatch.setenv(cpu_features.CPU_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="LORAPLEX_CPU_DTYPE must be one of float32, bfloat16"):
        default_cpu_dtype()
