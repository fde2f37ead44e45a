"""Read and validate a PEFT LoRA adapter directory against the base model it will run on. Torch-free.

    read_peft_adapter(dir, model_config, name=...)      -> PeftAdapterContents (manifest + float32 numpy factors)
    validate_peft_adapter(dir, model_config, name=...)  -> AdapterManifest (same checks, factors dropped)

The gateway validates uploads with this module and never loads torch; the engine turns the factors into
tensors with adapters.lora_adapter.load_peft_adapter. Only adapter_model.safetensors is read; pickle files
(adapter_model.bin) are never opened. Every problem is an AdapterError whose one-line message names the
file, field or tensor at fault.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import numpy as np
from safetensors import SafetensorError, deserialize

from adapters.adapter_files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    PICKLE_WEIGHT_FILES,
    adapter_digest,
)
from adapters.errors import AdapterError
from adapters.manifest import AdapterManifest
from adapters.peft_config import ModuleKey, PeftLoraConfig, module_path
from wire.checkpoint import LORA_TARGET_MODULES, ModelConfig

_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<module>[A-Za-z0-9_]+)\.lora_(?P<factor>A|B)\.weight$"
)
# safetensors dtype -> little-endian numpy dtype it is read as (BF16: the upper half of a float32).
_FLOAT_DTYPES = {"F16": "<f2", "BF16": "<u2", "F32": "<f4", "F64": "<f8"}
# Largest finite magnitude of each compute dtype a model may run in (config.json's torch_dtype): a weight or a
# scaling beyond it becomes inf in the slot buffers (float32: 1e39; float16: 70000). Unknown names: float32.
DTYPE_MAX = {"float32": float(np.finfo(np.float32).max), "bfloat16": 3.3895313892515355e38,
             "float16": float(np.finfo(np.float16).max)}
_Tensor = Mapping[str, Any]  # one entry of safetensors.deserialize: {"dtype": str, "shape": list, "data": bytes}


@dataclass(frozen=True)
class LoRAFactors:
    """The factors of one (layer, projection), float32 numpy: lora_a (r, in_features), lora_b (out_features, r)."""

    lora_a: np.ndarray
    lora_b: np.ndarray
    scaling: float


@dataclass(frozen=True)
class PeftAdapterContents:
    manifest: AdapterManifest
    factors: Mapping[ModuleKey, LoRAFactors]


def read_peft_adapter(
    adapter_dir: str | Path,
    model_config: ModelConfig,
    *,
    name: str,
    max_lora_rank: int = 64,
    accepted_base_models: Sequence[str] | None = None,
) -> PeftAdapterContents:
    """Read and validate a PEFT adapter directory. This operation does not modify the directory.

    Every factor and every module's scaling must be finite in float32 (the host copy and the slot's
    scaling buffer) and in `model_config.torch_dtype` (the compute dtype; an engine passes the dtype it
    really runs in). accepted_base_models: names/paths the served base model is known by (its path, its served name);
    None skips the check. An adapter that declares no base_model_name_or_path passes it (shapes decide).
    """
    manifest, factors = _read_adapter(adapter_dir, model_config, name, max_lora_rank, accepted_base_models)
    return PeftAdapterContents(manifest, factors)


def validate_peft_adapter(
    adapter_dir: str | Path,
    model_config: ModelConfig,
    *,
    name: str,
    max_lora_rank: int = 64,
    accepted_base_models: Sequence[str] | None = None,
) -> AdapterManifest:
    """Run every check read_peft_adapter runs (tensor values included) and keep only the manifest."""
    manifest, _ = _read_adapter(adapter_dir, model_config, name, max_lora_rank, accepted_base_models)
    return manifest


def base_model_matches(declared: str, accepted: Sequence[str]) -> bool:
    """True when the adapter's base_model_name_or_path names one of `accepted`.

    Compares, case-insensitively and ignoring trailing slashes, the full strings and their last path
    components, so "/models/Llama-3-8B", "meta-llama/Llama-3-8B" and "Llama-3-8B" all match each other.
    """
    forms = _name_forms(declared)
    return any(forms & _name_forms(candidate) for candidate in accepted)


def _name_forms(value: str) -> set[str]:
    text = value.strip().rstrip("/\\")
    if not text:
        return set()
    basename = PureWindowsPath(text).name if "\\" in text else PurePosixPath(text).name
    return {text.casefold(), basename.casefold()}


def _read_adapter(
    adapter_dir: str | Path,
    model_config: ModelConfig,
    name: str,
    max_lora_rank: int,
    accepted_base_models: Sequence[str] | None,
) -> tuple[AdapterManifest, dict[ModuleKey, LoRAFactors]]:
    if not name:
        raise AdapterError("adapter name must not be empty")
    directory = Path(adapter_dir)
    config_bytes, weights_bytes = _read_files(directory)
    try:
        raw = json.loads(config_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{ADAPTER_CONFIG_FILE}: invalid JSON ({e})") from None
    except RecursionError:  # nested deeper than the parser recurses
        raise AdapterError(f"{ADAPTER_CONFIG_FILE}: nested too deeply") from None
    config = PeftLoraConfig.from_dict(raw)
    declared = config.base_model_name_or_path
    if (
        accepted_base_models is not None
        and declared
        and not base_model_matches(declared, accepted_base_models)
    ):
        raise AdapterError(
            f"adapter was trained for base model {declared!r}, but this server serves "
            f"{', '.join(repr(a) for a in accepted_base_models)}"
        )
    targets = config.resolve_targets(model_config)
    dtype = model_config.torch_dtype if model_config.torch_dtype in DTYPE_MAX else "float32"
    limit = min(DTYPE_MAX[dtype], DTYPE_MAX["float32"])
    ranks = {key: config.rank_for(key) for key in targets}
    rank = max(ranks.values())
    if rank > max_lora_rank:
        widest = max(ranks, key=ranks.__getitem__)
        raise AdapterError(
            f"adapter rank {rank} (at {module_path(*widest)}) is above this server's max_lora_rank {max_lora_rank}"
        )

    weights_sha256 = hashlib.sha256(weights_bytes).hexdigest()
    tensors = _parse_safetensors(weights_bytes)
    factors = _collect_factors(tensors, set(targets), model_config.num_layers)
    shapes = model_config.lora_module_shapes()
    weights: dict[ModuleKey, LoRAFactors] = {}
    for key in targets:
        in_features, out_features = shapes[key[1]]
        r = ranks[key]
        a = _checked_factor(factors, key, "A", (r, in_features), dtype, limit)  # (r, in_features)
        b = _checked_factor(factors, key, "B", (out_features, r), dtype, limit)  # (out_features, r)
        scaling = config.scaling_for(key)
        if not abs(scaling) <= limit:
            raise AdapterError(
                f"{ADAPTER_CONFIG_FILE}: the scaling of {module_path(*key)} (lora_alpha / "
                f"{'sqrt(r)' if config.use_rslora else 'r'}) is {scaling:.3g}, beyond the range of {dtype}, "
                "the model's compute dtype"
            )
        weights[key] = LoRAFactors(lora_a=a, lora_b=b, scaling=scaling)

    manifest = AdapterManifest(
        name=name,
        sha256=adapter_digest(config_bytes, weights_sha256),
        weights_sha256=weights_sha256,
        rank=rank,
        target_modules=tuple(m for m in LORA_TARGET_MODULES if any(k[1] == m for k in targets)),
        layers=tuple(sorted({k[0] for k in targets})),
        module_ranks=ranks,
        module_scalings={key: w.scaling for key, w in weights.items()},
        size_bytes=len(weights_bytes),
        num_parameters=sum(w.lora_a.size + w.lora_b.size for w in weights.values()),
        base_model_name_or_path=declared,
    )
    return manifest, weights


def _read_files(directory: Path) -> tuple[bytes, bytes]:
    if not directory.is_dir():
        raise AdapterError(f"{directory}: not a directory")
    weights_file = directory / ADAPTER_WEIGHTS_FILE
    if not weights_file.is_file():
        pickles = [p for p in PICKLE_WEIGHT_FILES if (directory / p).exists()]
        if pickles:
            raise AdapterError(
                f"{pickles[0]} is a pickle file, which loraplex never loads; save the adapter with "
                f"safe_serialization=True to get {ADAPTER_WEIGHTS_FILE}"
            )
        raise AdapterError(f"{ADAPTER_WEIGHTS_FILE} is missing from the adapter directory")
    config_file = directory / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        raise AdapterError(f"{ADAPTER_CONFIG_FILE} is missing from the adapter directory")
    return config_file.read_bytes(), weights_file.read_bytes()


def _parse_safetensors(data: bytes) -> dict[str, _Tensor]:
    """Header and raw bytes of every tensor (the Rust parser checks offsets, sizes and the header)."""
    try:
        return dict(deserialize(data))
    except (SafetensorError, ValueError, RuntimeError, TypeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AdapterError(f"{ADAPTER_WEIGHTS_FILE} is not a valid safetensors file ({reason})") from None


def _collect_factors(
    tensors: dict[str, _Tensor], targets: set[ModuleKey], num_layers: int
) -> dict[tuple[int, str, str], tuple[str, _Tensor]]:
    """Map each weight key to (layer, projection, "A"|"B"); refuse keys that map to no targeted module."""
    factors: dict[tuple[int, str, str], tuple[str, _Tensor]] = {}
    for key, tensor in tensors.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise AdapterError(_unmapped_key_problem(key))
        layer, module, factor = int(match["layer"]), match["module"], match["factor"]
        if module not in LORA_TARGET_MODULES or module_path(layer, module).split(".")[3] != match["parent"]:
            raise AdapterError(f"weight {key} does not map to a LoRA projection of a Llama-family model")
        if layer >= num_layers:
            raise AdapterError(
                f"weight {key} is for layer {layer}, but the base model has {num_layers} layers"
            )
        if (layer, module) not in targets:
            raise AdapterError(
                f"weight {key} is for {module_path(layer, module)}, which {ADAPTER_CONFIG_FILE} does not target"
            )
        if (layer, module, factor) in factors:
            raise AdapterError(f"weight {key} duplicates {factors[(layer, module, factor)][0]}")
        factors[(layer, module, factor)] = (key, tensor)
    return factors


def _unmapped_key_problem(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
        return f"weight {key} adapts an embedding or lm_head, which is not supported"
    if "lora_magnitude_vector" in key:
        return f"weight {key} is a DoRA magnitude vector; DoRA is not supported"
    if key.endswith("lora_B.bias") or key.endswith("lora_A.bias"):
        return f"weight {key} is a LoRA bias, which is not supported"
    return (
        f"weight key {key!r} does not map to a LoRA module (expected "
        "base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight)"
    )


def _checked_factor(
    factors: dict[tuple[int, str, str], tuple[str, _Tensor]],
    key: ModuleKey,
    factor: str,
    expected_shape: tuple[int, int],
    compute_dtype: str,
    limit: float,
) -> np.ndarray:
    entry = factors.get((*key, factor))
    if entry is None:
        raise AdapterError(
            f"weight base_model.model.{module_path(*key)}.lora_{factor}.weight is missing "
            f"({module_path(*key)} needs both lora_A and lora_B)"
        )
    tensor_key, tensor = entry
    dtype, shape = tensor["dtype"], tuple(tensor["shape"])
    if dtype not in _FLOAT_DTYPES:
        raise AdapterError(
            f"tensor {tensor_key} has dtype {dtype}; expected a float dtype ({', '.join(_FLOAT_DTYPES)})"
        )
    if shape != expected_shape:
        raise AdapterError(f"tensor {tensor_key} has shape {shape}, but the base model needs {expected_shape}")
    as_fp32 = _to_float32(tensor["data"], dtype).reshape(shape)
    if not bool(np.isfinite(as_fp32).all()):
        raise AdapterError(f"tensor {tensor_key} contains NaN or Inf values")
    largest = float(np.abs(as_fp32).max()) if as_fp32.size else 0.0
    if largest > limit:
        raise AdapterError(
            f"tensor {tensor_key} holds a value of magnitude {largest:.3g}, which is inf in {compute_dtype}, "
            "the model's compute dtype"
        )
    return as_fp32


def _to_float32(data: bytes, dtype: str) -> np.ndarray:
    """A new, writable float32 array of a float tensor's raw little-endian bytes (widening is exact;
    F64 rounds to nearest, as torch's .to(float32) does)."""
    raw = np.frombuffer(data, dtype=_FLOAT_DTYPES[dtype])
    if dtype == "BF16":  # bfloat16 is the upper 16 bits of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    with np.errstate(over="ignore"):  # an F64 beyond float32 becomes inf, which the caller refuses
        return raw.astype(np.float32)
