"""A validated LoRA adapter: what it is (AdapterManifest) and, when loaded, its factors (LoRAAdapter).

The math of one adapted projection, for input x of shape (tokens, in_features):
    y = base(x) + scaling * (x @ lora_a.T) @ lora_b.T
with lora_a (rank, in_features) and lora_b (out_features, rank), both float32 on CPU. Converting these to
stacked, rank-padded device tensors is the slot cache's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from adapters.adapter_files import is_sha256_hex
from adapters.peft_config import ModuleKey


@dataclass(frozen=True)
class LoRAModuleWeights:
    """The two LoRA factors of one (layer, projection) and the scale applied to their product."""

    lora_a: torch.Tensor  # (rank, in_features), float32
    lora_b: torch.Tensor  # (out_features, rank), float32
    scaling: float

    def __post_init__(self) -> None:
        if self.lora_a.dim() != 2 or self.lora_b.dim() != 2 or self.lora_a.shape[0] != self.lora_b.shape[1]:
            raise ValueError(
                f"lora_a {tuple(self.lora_a.shape)} and lora_b {tuple(self.lora_b.shape)} are not (r, in) and (out, r)"
            )

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class AdapterManifest:
    """Everything validation proves about an adapter, without its tensors (the upload path keeps this)."""

    name: str
    sha256: str  # content digest of config + weights (adapters.adapter_files.adapter_digest)
    weights_sha256: str  # SHA-256 of the adapter_model.safetensors bytes
    rank: int  # the largest rank of any module
    target_modules: tuple[str, ...]  # adapted projections, in engine.config.LORA_TARGET_MODULES order
    layers: tuple[int, ...]  # layers with at least one adapted projection
    module_ranks: Mapping[ModuleKey, int]
    module_scalings: Mapping[ModuleKey, float]
    size_bytes: int  # bytes of adapter_model.safetensors
    num_parameters: int  # elements of all LoRA factors (times 4 = bytes once loaded as float32)
    base_model_name_or_path: str | None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("adapter name must not be empty")
        if not is_sha256_hex(self.sha256) or not is_sha256_hex(self.weights_sha256):
            raise ValueError("sha256 and weights_sha256 must be 64 lowercase hex digits")
        if set(self.module_ranks) != set(self.module_scalings):
            raise ValueError("module_ranks and module_scalings must cover the same modules")
        object.__setattr__(self, "module_ranks", MappingProxyType(dict(self.module_ranks)))
        object.__setattr__(self, "module_scalings", MappingProxyType(dict(self.module_scalings)))

    @property
    def identity(self) -> tuple[str, str]:
        """(name, sha256): two adapters are the same exactly when both agree."""
        return (self.name, self.sha256)


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: its manifest plus float32 CPU factors for every adapted (layer, projection).

    The mapping is read-only; the tensors must be treated as read-only too (they may be shared with
    device copies made from them).
    """

    manifest: AdapterManifest
    weights: Mapping[ModuleKey, LoRAModuleWeights]

    def __post_init__(self) -> None:
        if set(self.weights) != set(self.manifest.module_ranks):
            raise ValueError("weights must cover exactly the manifest's modules")
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def sha256(self) -> str:
        return self.manifest.sha256

    @property
    def rank(self) -> int:
        return self.manifest.rank

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self.manifest.target_modules

    @property
    def size_bytes(self) -> int:
        return self.manifest.size_bytes

    @property
    def base_model_name_or_path(self) -> str | None:
        return self.manifest.base_model_name_or_path

    @property
    def identity(self) -> tuple[str, str]:
        return self.manifest.identity

    def module(self, layer: int, projection: str) -> LoRAModuleWeights | None:
        """Factors of one projection, or None where the adapter leaves it unchanged."""
        return self.weights.get((layer, projection))
