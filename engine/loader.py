"""Read an HF checkpoint directory into named tensors, checking every tensor the model needs."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.config import CheckpointError, ModelConfig
from engine.quantization import QuantizationSpec, is_linear_weight, is_tied_table, quantize, read_gptq
from kernels.quant import Weight, quantize_int8


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name (HF naming) the model reads, with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for name, (fan_in, fan_out) in cfg.lora_module_shapes().items():
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            shapes[f"{p}{group}.{name}.weight"] = (fan_out, fan_in)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: invalid index ({e})") from None
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{model_dir}: shard {f.name} named in the index is missing")
        return files
    if single.is_file():
        try:
            with safe_open(str(single), "pt") as f:
                return dict.fromkeys(f.keys(), single)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{single}: not a readable safetensors file ({e})") from None
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise CheckpointError(f"{model_dir}: only safetensors weights are supported (found pickle .bin/.pt files)")
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_weights(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, quantization: QuantizationSpec | None = None
) -> dict[str, Weight]:
    """All tensors `expected_shapes(cfg)` names, cast to dtype. CheckpointError names any problem.

    With `quantization`, every linear weight (engine.quantization.is_linear_weight) comes back quantized
    instead: quantized here tensor by tensor as it is read (at most one full-precision fp32 copy of one
    tensor at a time), or repacked from a GPTQ checkpoint's qweight/qzeros/scales; and a tied embedding
    table as int8 per row where the spec says so (tied_table_int8).
    """
    path = Path(model_dir)
    files = _weight_files(path)
    want = expected_shapes(cfg)
    gptq = quantization is not None and quantization.source == "gptq"

    def gptq_prefix(name: str) -> str | None:
        prefix = name.removesuffix("weight")
        return prefix if gptq and is_linear_weight(name, cfg) and prefix + "qweight" in files else None

    missing = [n for n in want if n not in files and gptq_prefix(n) is None]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {missing[0]}{more}")
    out: dict[str, Weight] = {}
    with _TensorReader(files) as read:
        for name, shape in want.items():
            prefix = gptq_prefix(name)
            if prefix is not None and quantization is not None:
                out[name] = read_gptq(read, prefix, shape, quantization, dtype)
                continue
            t = read(name)
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{path}: tensor {name} has shape {tuple(t.shape)}, config implies {shape}")
            if quantization is not None and quantization.source == "load" and is_linear_weight(name, cfg):
                out[name] = quantize(t.float(), quantization, dtype)
            elif quantization is not None and quantization.tied_table_int8 and is_tied_table(name, cfg):
                out[name] = quantize_int8(t.float(), dtype)  # weight-only: the logits read x as it is
            else:
                out[name] = t.to(dtype)
    return out


class _TensorReader:
    """Reads tensors by name from a checkpoint's safetensors files, each file opened once.
    KeyError for a name no file holds; CheckpointError for an unreadable file."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __enter__(self) -> _TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __call__(self, name: str) -> torch.Tensor:
        file = self._files[name]
        try:
            if file not in self._open:
                self._open[file] = self._stack.enter_context(safe_open(str(file), "pt"))
            return self._open[file].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def read_generation_config(model_dir: str | Path) -> dict:
    f = Path(model_dir) / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from None
