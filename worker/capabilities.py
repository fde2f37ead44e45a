"""What one worker serves, declared where the worker is assembled (never probed from the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig


@dataclass(frozen=True)
class WorkerCapabilities:
    structured_output: bool  # json_schema / json_object / regex / choice constraints
    adapters: bool  # LoRA adapters (loaded on the first request that names one)
    max_loras: int = 0  # distinct adapters one engine step runs (0 without adapters)
    max_lora_rank: int = 0  # the largest adapter rank it loads (0 without adapters)

    def __post_init__(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 0:
            raise ValueError("max_loras and max_lora_rank must be >= 0")
        if self.adapters and (self.max_loras < 1 or self.max_lora_rank < 1):
            raise ValueError("a worker that serves adapters needs max_loras >= 1 and max_lora_rank >= 1")

    @classmethod
    def of_engine(cls, config: EngineConfig) -> WorkerCapabilities:
        """What an LLMEngine with `config` serves: every constraint kind, and adapters up to its limits."""
        return cls(structured_output=True, adapters=True, max_loras=config.max_loras,
                   max_lora_rank=config.max_lora_rank)
