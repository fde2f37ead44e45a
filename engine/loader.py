"""Read an HF checkpoint directory into named tensors, checking every tensor the model needs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.config import CheckpointError, ModelConfig


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


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors `expected_shapes(cfg)` names, cast to dtype. CheckpointError names any problem."""
    path = Path(model_dir)
    files = _weight_files(path)
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: missing tensor {missing[0]}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(file), "pt") as f:
                for name in names:
                    t = f.get_tensor(name)
                    if tuple(t.shape) != want[name]:
                        raise CheckpointError(
                            f"{path}: tensor {name} has shape {tuple(t.shape)}, config implies {want[name]}"
                        )
                    out[name] = t.to(dtype)
        except SafetensorError as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
    return out


def read_generation_config(model_dir: str | Path) -> dict:
    f = Path(model_dir) / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: invalid JSON ({e})") from None
