"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.request import AdapterRef
from wire.sampling import SamplingParams


class LLM:
    """Batch generation over one engine. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        adapters: one loaded adapter name (or None for the base model) per prompt.
        """
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"give one adapter (or None) per prompt: {len(adapters)} for {len(prompts)} prompts")
        ids: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompts, param_list, strict=True)):
            rid = f"offline-{next(self._ids)}"
            try:
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                        adapter=adapters[i] if adapters else None)
            except ValueError:
                for queued in ids:
                    self.engine.abort_request(queued)
                raise
            ids.append(rid)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
            self.engine.wait_for_adapter_loads(0.05)
        return [finals[r] for r in ids]

    def load_adapter(self, name: str, path: str | Path, *, sha256: str | None = None) -> AdapterRef:
        """Validate and register a PEFT adapter directory (LLMEngine.load_adapter)."""
        return self.engine.load_adapter(name, path, sha256=sha256)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        self.engine.pin_adapter(name, pinned)
