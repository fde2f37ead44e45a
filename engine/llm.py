"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


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
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params or SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, param_list, strict=True)):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
            ids.append(rid)
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[r] for r in ids]
