"""loraplex engine: paged KV, continuous batching, radix prefix cache, multi-LoRA, grammar masks.

The loop lives in engine/llm_engine.py: `LLMEngine.step()` = schedule -> execute -> update.

NOTE: `LLM` and `EngineConfig` are imported on first use, so that importing one engine module (say
engine.outputs) does not load torch, the model, the kernels and the grammar backends with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.outputs import CompletionOutput, RequestOutput
from wire.checkpoint import CheckpointError, ModelConfig
from wire.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM

__all__ = ["LLM", "CheckpointError", "CompletionOutput", "EngineConfig", "ModelConfig", "RequestOutput",
           "SamplingParams"]


def __getattr__(name: str) -> object:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
