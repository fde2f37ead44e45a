"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, like vLLM's.

The one place where the engine's deltas are summed into whole outputs (engine/outputs.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import OutputAccumulator, RequestOutput
from engine.request import AdapterRef
from wire.errors import RequestError
from wire.sampling import SamplingParams


class LLM:
    """Batch generation over one engine. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's background threads; the LLM generates nothing after it."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        adapters: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        adapters: one loaded adapter name (or None for the base model) per prompt. Raises ValueError
        (and queues nothing) when a prompt can never be served; a request the engine fails while running
        comes back with `error` set and its samples ending with "error".
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
        outputs: dict[str, OutputAccumulator] = {}
        for i, (prompt, p) in enumerate(zip(prompts, param_list, strict=True)):
            rid = f"offline-{next(self._ids)}"
            try:
                prompt_ids = self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                                     adapter=adapters[i] if adapters else None)
            except ValueError:
                for queued in ids:
                    self.engine.abort_request(queued)
                raise
            ids.append(rid)
            outputs[rid] = OutputAccumulator(rid, _prompt_text(prompt), prompt_ids, p.n, p.logprobs is not None)
        while self.engine.has_unfinished_requests():
            for item in self.engine.step():
                acc = outputs.get(item.request_id)
                if acc is None:
                    continue
                if isinstance(item, RequestError):
                    acc.fail(item)
                else:
                    acc.add(item)
            self.engine.wait_for_adapter_loads(0.05)
        return [outputs[r].output() for r in ids]

    def load_adapter(self, name: str, path: str | Path, *, sha256: str | None = None) -> AdapterRef:
        """Validate and register a PEFT adapter directory (LLMEngine.load_adapter)."""
        return self.engine.load_adapter(name, path, sha256=sha256)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        self.engine.pin_adapter(name, pinned)


def _prompt_text(prompt: PromptType) -> str | None:
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt") if isinstance(prompt, dict) else None
