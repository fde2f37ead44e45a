"""loraplex engine: paged KV, continuous batching, radix prefix cache, multi-LoRA, grammar masks.

The loop lives in engine/llm_engine.py: `LLMEngine.step()` = schedule -> execute -> update.
"""

from engine.config import CheckpointError, EngineConfig, ModelConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from wire.sampling import SamplingParams

__all__ = ["LLM", "CheckpointError", "CompletionOutput", "EngineConfig", "ModelConfig", "RequestOutput",
           "SamplingParams"]
