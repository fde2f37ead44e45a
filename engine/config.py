"""Frozen configurations: the model's (read from config.json) and the engine's (chosen by the user).

Values found at run time (the number of KV blocks that fit) are returned by the runner, never written
back into a config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.attention import NATIVE_CACHE_DTYPES
from kernels.cpu_features import cpu_dtype_reason, default_cpu_dtype
from kernels.quant import INT4_GROUP_SIZES
from wire.checkpoint import (  # noqa: F401  (re-exported: the engine's public config names)
    LORA_TARGET_MODULES,
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    ModelConfig,
    RopeConfig,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("none", "int8", "int4", "w8a8", "w4a8")
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "int8": torch.int8}  # besides "auto", the compute dtype


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Frozen; validated on construction."""

    model: str
    device: str = "cpu"
    # "auto" = the checkpoint's dtype on CUDA; on CPU bfloat16 where the CPU has native bf16, float32 elsewhere
    # (kernels.cpu_features); quantized, bf16 unless that CPU's native int8/int4 kernels read float32 (AVX2:
    # int8, w8a8, int4 and GPTQ checkpoints; torch's packed int kernels take bf16 activations)
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the pool from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    max_loras: int = 8
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # None: 4 * max_loras
    seed: int = 0
    # Quantization at load (engine.quantization): weight-only "int8" (per output channel) or "int4"
    # (group-wise), or "w8a8" (int8 weights per output channel, activations rounded to int8 per token at
    # each projection), or "w4a8" (int4 weights as int4's, activations as w8a8's); "none". A GPTQ checkpoint
    # runs as int4 (or w4a8, when asked) either way.
    quantization: str = "none"
    quantization_group_size: int | None = None  # int4/w4a8 only; None: the largest of 128/64/32 that fits the model
    # With quantization, also hold a tied embedding table (the lm_head of a tie_word_embeddings model) as int8
    # per row: the embedding lookup and the lm_head read the one table (llama.cpp's quantized files keep it
    # Q8_0). Off: a tied table stays in the activation dtype. An untied lm_head is quantized either way.
    quantize_lm_head: bool = False
    # Decode steps through fixed-size buckets with persistent inputs (engine.decode_graph), replayed as CUDA
    # graphs on a GPU. None: on for CUDA, off on the CPU (no launch overhead to save there; measured).
    decode_graphs: bool | None = None
    decode_graph_max_batch: int = 32  # the largest bucket; bigger decode batches run the plain path
    # The KV cache's dtype: "auto" = the compute dtype; "bfloat16" (under float32 compute: half the cache
    # bytes, as llama.cpp keeps f16 caches for F32 weights) or "int8" (one float32 scale per slot and head,
    # kernels.attention; a quarter to a half of the bytes). CPU path only.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.decode_graph_max_batch < 1:
            raise ValueError(f"decode_graph_max_batch must be positive, got {self.decode_graph_max_batch}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and not self.device.startswith("cpu"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} runs on the CPU path only; use auto on {self.device}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_group_size is not None and (
                self.quantization not in ("int4", "w4a8") or self.quantization_group_size not in INT4_GROUP_SIZES):
            raise ValueError(f"quantization_group_size applies to int4 and w4a8 only and must be one of "
                             f"{', '.join(map(str, INT4_GROUP_SIZES))}, got {self.quantization_group_size}")

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.device.startswith("cuda"):
            return DTYPES.get(model_config.torch_dtype, torch.bfloat16)
        if self.quantization != "none" or "quantization_config" in model_config.raw:
            return torch.float32 if self._quantized_reads_float32(model_config) else torch.bfloat16
        return default_cpu_dtype()

    def kv_cache_torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        """The KV cache's dtype; ValueError when the compute dtype cannot use it (a cache is never coarser
        than the compute dtype, and a finer one needs float32 or bfloat16 compute)."""
        compute = self.torch_dtype(model_config)
        if self.kv_cache_dtype == "auto":
            return compute
        cache = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if cache not in NATIVE_CACHE_DTYPES.get(compute, ()):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs float32 compute"
                             f"{'' if cache == torch.bfloat16 else ' or bfloat16'}, not "
                             f"{str(compute).removeprefix('torch.')}")
        return cache

    def _quantized_reads_float32(self, model_config: ModelConfig) -> bool:
        """On a CPU without native bf16: whether the native kernels of this quantization (int8, w8a8, int4, w4a8,
        and a GPTQ checkpoint's int4 or w4a8) read float32 activations here (kernels.native_cpu; AVX2 builds).
        Elsewhere quantized weights take bf16 activations (torch's packed kernels; fp32 ones would dequantize
        every step)."""
        method = self.quantization
        if "quantization_config" in model_config.raw and method != "w4a8":  # GPTQ: 4-bit only
            method = "int4"
        if method not in ("int8", "w8a8", "int4", "w4a8") or default_cpu_dtype() is not torch.float32:
            return False
        from kernels import native_cpu  # builds the ops once per machine (the engine loads them anyway)

        ops = native_cpu.ops()
        if ops is None:
            return False
        has = {"int8": ops.has_int8_linear_f32, "w8a8": ops.has_w8a8_linear_f32, "int4": ops.has_int4_linear_f32,
               "w4a8": ops.has_w4a8_linear}
        return bool(has[method]())

    def dtype_reason(self, model_config: ModelConfig) -> str:
        """One start-up line: the compute dtype and why it was chosen."""
        name = str(self.torch_dtype(model_config)).removeprefix("torch.")
        if self.dtype != "auto":
            return f"{name}: set by dtype={self.dtype}"
        if self.device.startswith("cuda"):
            return f"{name}: the checkpoint's dtype on CUDA"
        if self.quantization != "none" or "quantization_config" in model_config.raw:
            if name == "float32":
                return "float32: the CPU has no native bf16 and its native int8/int4 kernels read float32 activations"
            return f"{name}: quantized weights take bf16 activations on CPU"
        return cpu_dtype_reason()

    def uses_decode_graphs(self) -> bool:
        return self.device.startswith("cuda") if self.decode_graphs is None else self.decode_graphs

    def resolved_max_model_len(self, model_config: ModelConfig) -> int:
        return self.max_model_len or model_config.max_position_embeddings

    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)
