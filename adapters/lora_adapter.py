"""A loaded LoRA adapter: its manifest (adapters.manifest) plus torch factors, and `load_peft_adapter`.

The math of one adapted projection, for input x of shape (tokens, in_features):
    y = base(x) + scaling * (x @ lora_a.T) @ lora_b.T
with lora_a (rank, in_features) and lora_b (out_features, rank), both float32 on CPU. Converting these to
stacked, rank-padded device tensors is the slot cache's business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from adapters.manifest import AdapterManifest
from adapters.peft_config import ModuleKey
from adapters.peft_format import read_peft_adapter
from wire.checkpoint import ModelConfig


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


def load_peft_adapter(
    adapter_dir: str | Path,
    model_config: ModelConfig,
    *,
    name: str,
    max_lora_rank: int = 64,
    accepted_base_models: Sequence[str] | None = None,
) -> LoRAAdapter:
    """Read, validate and convert a PEFT adapter directory (adapters.peft_format.read_peft_adapter) into
    float32 CPU tensors. This operation does not modify the directory. Raises AdapterError."""
    contents = read_peft_adapter(adapter_dir, model_config, name=name, max_lora_rank=max_lora_rank,
                                 accepted_base_models=accepted_base_models)
    weights = {
        key: LoRAModuleWeights(lora_a=torch.from_numpy(f.lora_a), lora_b=torch.from_numpy(f.lora_b),
                               scaling=f.scaling)
        for key, f in contents.factors.items()
    }
    return LoRAAdapter(manifest=contents.manifest, weights=weights)
