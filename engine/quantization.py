"""Quantization at load: which scheme a model runs with, and pre-quantized GPTQ checkpoints.

Every linear layer is quantized: the seven projections of each decoder layer, and lm_head unless it is
tied to the embedding table (the embedding lookup reads those rows, so a tied table stays in the
activation dtype unless `--quantize-lm-head` asks for it as int8 per row, which the lookup and the lm_head
then both read). Norms, biases and untied embeddings keep the activation dtype. The math and the kernels
are in kernels.quant.

- `--quantization int8 | int4` quantizes a full-precision checkpoint tensor by tensor as it is read
  (weight-only: the activations stay in their dtype); `w8a8` quantizes the weights as int8 does and has
  every projection round its input rows to int8 (per token, dynamic scales) for int8 x int8 products;
  `w4a8` quantizes the weights as int4 does and rounds the inputs as w8a8 does (int4 x int8 products).
- A checkpoint whose config.json carries a GPTQ `quantization_config` (4-bit, groups in k order) loads as
  int4 whatever `--quantization` says (none or int4; w4a8 keeps its weights and rounds the inputs), its
  qweight/qzeros/scales repacked for the device.
  Every other variant is refused with one line naming what is unsupported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.config import CheckpointError, EngineConfig, ModelConfig
from kernels.quant import (
    INT4_GROUP_SIZES,
    Int4Weight,
    QuantizedWeight,
    int4_from_values,
    quantize_int4,
    quantize_int8,
)

DEFAULT_INT4_GROUP_SIZES = (128, 64, 32)  # the first that divides every layer's in_features
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores each zero point minus one; v2 stores it as is


@dataclass(frozen=True)
class QuantizationSpec:
    """How this model's linear weights are held. `source`: quantized here at load, or read from GPTQ."""

    method: Literal["int8", "int4", "w8a8", "w4a8"]  # w8a8/w4a8: activations rounded to int8 per token
    group_size: int | None  # int4/w4a8: per group of in_features; None for int8 and w8a8 (per output channel)
    source: Literal["load", "gptq"] = "load"
    checkpoint_format: str = "gptq"  # GPTQ only
    tied_table_int8: bool = False  # a tied embedding table (and so the lm_head) as int8 per row

    def describe(self) -> str:
        group = f", group size {self.group_size}" if self.group_size and self.group_size > 0 else ""
        return (f"{self.method}{group}" + (" (GPTQ checkpoint)" if self.source == "gptq" else "")
                + (", tied lm_head int8" if self.tied_table_int8 else ""))


def resolve(config: EngineConfig, model_config: ModelConfig) -> QuantizationSpec | None:
    """The quantization the engine runs `model_config` with (None: none). CheckpointError (one line) for a
    pre-quantized checkpoint of an unsupported kind or an int4 group size that does not fit the model."""
    spec = _resolve(config, model_config)
    if not config.quantize_lm_head:
        return spec
    if spec is None:
        raise CheckpointError("--quantize-lm-head needs --quantization (or a GPTQ checkpoint)")
    return dataclasses.replace(spec, tied_table_int8=model_config.tie_word_embeddings)


def _resolve(config: EngineConfig, model_config: ModelConfig) -> QuantizationSpec | None:
    gptq = model_config.raw.get("quantization_config")
    if gptq is not None:
        return _resolve_gptq(gptq, config)
    if config.quantization == "none":
        return None
    if config.quantization == "int8":
        return QuantizationSpec("int8", None)
    if config.quantization == "w8a8":
        return QuantizationSpec("w8a8", None)
    method: Literal["int4", "w4a8"] = "w4a8" if config.quantization == "w4a8" else "int4"
    features = sorted({model_config.hidden_size, model_config.q_size, model_config.intermediate_size})
    if config.quantization_group_size is not None:
        bad = [k for k in features if k % config.quantization_group_size]
        if bad:
            fits = [g for g in INT4_GROUP_SIZES if all(k % g == 0 for k in features)]
            raise CheckpointError(f"int4 group size {config.quantization_group_size} does not divide in_features "
                                  f"{bad[0]} of this model (group sizes that fit: {fits or 'none'})")
        return QuantizationSpec(method, config.quantization_group_size)
    fitting = [g for g in DEFAULT_INT4_GROUP_SIZES if all(k % g == 0 for k in features)]
    if not fitting:
        raise CheckpointError(f"{method} needs in_features divisible by 32; this model has {features}")
    return QuantizationSpec(method, fitting[0])


def is_tied_table(name: str, cfg: ModelConfig) -> bool:
    """True for the embedding table a tied lm_head reads (QuantizationSpec.tied_table_int8 holds it as int8)."""
    return name == "model.embed_tokens.weight" and cfg.tie_word_embeddings


def is_linear_weight(name: str, cfg: ModelConfig) -> bool:
    """True for the HF tensor names this module quantizes (projection weights, an untied lm_head)."""
    if name == "lm_head.weight":
        return not cfg.tie_word_embeddings
    return name.endswith("_proj.weight")


def quantize(weight: torch.Tensor, spec: QuantizationSpec, dtype: torch.dtype) -> QuantizedWeight:
    """Quantize one (N, K) full-precision weight as `spec` says; scales in the activation `dtype`."""
    if spec.method in ("int8", "w8a8"):
        return quantize_int8(weight, dtype, "int8" if spec.method == "w8a8" else "float")
    group = spec.group_size
    if group is None or weight.shape[1] % group:  # an untied lm_head over hidden: the default always fits
        raise CheckpointError(f"int4 group size {group} does not divide in_features {weight.shape[1]}")
    return quantize_int4(weight, group, dtype, "int8" if spec.method == "w4a8" else "float")


def read_gptq(get: Callable[[str], torch.Tensor], prefix: str, shape: tuple[int, ...], spec: QuantizationSpec,
              dtype: torch.dtype) -> Int4Weight:
    """Repack one GPTQ linear (`prefix` + qweight, qzeros, scales, g_idx) of HF weight shape (N, K).

    GPTQ (AutoGPTQ / GPTQModel / optimum) stores, for 4 bits and a group size gs:
        qweight (K / 8, N) int32: q[8i + j, n] = (qweight[i, n] >> 4j) & 15
        qzeros  (K / gs, N / 8) int32: z[g, 8i + j] = ((qzeros[g, i] >> 4j) & 15) (+ 1 in format "gptq")
        scales  (K / gs, N) fp16;  g_idx (K,) int32, the group of each input (k // gs unless act-order)
        W[n, k] = scales[g, n] * (q[k, n] - z[g, n]),  g = g_idx[k]
    which is kernels.quant's int4 form with zero = (8 - z) * scale.
    """
    n, k = shape
    group = spec.group_size if spec.group_size and spec.group_size > 0 else k  # -1: one group per row
    where = f"{prefix}qweight"
    if k % 8 or n % 8 or k % group:
        raise CheckpointError(f"{where}: in/out features {k}/{n} do not fit 4-bit GPTQ groups of {group}")
    qweight, qzeros, scales = (_required(get, prefix + part) for part in ("qweight", "qzeros", "scales"))
    for t, name, want in ((qweight, "qweight", (k // 8, n)), (qzeros, "qzeros", (k // group, n // 8)),
                          (scales, "scales", (k // group, n))):
        if tuple(t.shape) != want:
            raise CheckpointError(f"{prefix}{name} has shape {tuple(t.shape)}, a 4-bit GPTQ layer of shape "
                                  f"{(n, k)} with group size {group} needs {want}")
    g_idx = _optional(get, prefix + "g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise CheckpointError(f"{prefix}g_idx: act-order (desc_act) group order is not supported; "
                              "re-quantize with desc_act=false")
    q = _unpack_int32(qweight.to(torch.int32), dim=0)  # (K, N) values 0..15
    z = _unpack_int32(qzeros.to(torch.int32), dim=1).float()  # (G, N)
    if spec.checkpoint_format == "gptq":
        z = z + 1
    s = scales.float()
    # Our kernels take groups of 32..256: a larger GPTQ group (or one per row) is split, scales repeated.
    inner = next(g for g in sorted(INT4_GROUP_SIZES, reverse=True) if group % g == 0) if group % 32 == 0 else 0
    if not inner:
        raise CheckpointError(f"{where}: GPTQ group size {group} is not a multiple of 32")
    repeat = group // inner
    s, z = s.repeat_interleave(repeat, dim=0), z.repeat_interleave(repeat, dim=0)
    zeros = ((8 - z) * s).to(dtype)
    return int4_from_values(q.T.contiguous(), s.to(dtype), zeros, inner, "int8" if spec.method == "w4a8" else "float")


def _resolve_gptq(qc: Any, config: EngineConfig) -> QuantizationSpec:
    where = "config.json quantization_config"
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: expected an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method != "gptq":
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported (supported: 4-bit gptq)")
    bits = qc.get("bits")
    if bits != 4:
        raise CheckpointError(f"{where}: GPTQ with bits={bits!r} is not supported (supported: 4)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in GPTQ_FORMATS:
        raise CheckpointError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported "
                              f"(supported: {', '.join(GPTQ_FORMATS)})")
    if qc.get("lm_head"):
        raise CheckpointError(f"{where}: a quantized lm_head (lm_head=true) is not supported")
    if qc.get("dynamic"):
        raise CheckpointError(f"{where}: per-module overrides (dynamic) are not supported")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        raise CheckpointError(f"{where}: GPTQ group_size {group!r} is not supported (supported: -1 or a "
                              "multiple of 32)")
    if config.quantization in ("int8", "w8a8"):
        raise CheckpointError(f"{config.model}: a 4-bit GPTQ checkpoint cannot run as {config.quantization}; use "
                              "--quantization none, int4 or w4a8")
    if config.quantization_group_size is not None and config.quantization_group_size != group:
        raise CheckpointError(f"{config.model}: the GPTQ checkpoint has group size {group}, not "
                              f"{config.quantization_group_size}")
    # desc_act=true alone is fine when the stored g_idx keeps groups in k order; read_gptq checks each layer.
    return QuantizationSpec("w4a8" if config.quantization == "w4a8" else "int4", group, "gptq", fmt)


def _unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values per int32, lowest bits first, unpacked along `dim` (8x longer), uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    values = (packed.unsqueeze(dim + 1) >> shifts.view([-1 if d == dim + 1 else 1 for d in range(packed.dim() + 1)])) & 15
    return values.flatten(dim, dim + 1).to(torch.uint8)


def _required(get: Callable[[str], torch.Tensor], name: str) -> torch.Tensor:
    try:
        return get(name)
    except KeyError:
        raise CheckpointError(f"GPTQ tensor {name} is missing") from None


def _optional(get: Callable[[str], torch.Tensor], name: str) -> torch.Tensor | None:
    try:
        return get(name)
    except KeyError:
        return None
