"""What validation proves about an adapter, without its tensors (torch-free: the gateway keeps this)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from adapters.adapter_files import is_sha256_hex
from adapters.peft_config import ModuleKey


@dataclass(frozen=True)
class AdapterManifest:
    """Everything validation proves about an adapter, without its tensors (the upload path keeps this)."""

    name: str
    sha256: str  # content digest of config + weights (adapters.adapter_files.adapter_digest)
    weights_sha256: str  # SHA-256 of the adapter_model.safetensors bytes
    rank: int  # the largest rank of any module
    target_modules: tuple[str, ...]  # adapted projections, in wire.checkpoint.LORA_TARGET_MODULES order
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
