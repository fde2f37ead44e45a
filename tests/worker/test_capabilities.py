"""A worker serves what it declares (WorkerCapabilities), and refuses the rest by name."""

from __future__ import annotations

import asyncio

import pytest

from demo.null_worker import NULL_CAPABILITIES, NullLLM
from engine.config import EngineConfig
from wire.errors import ErrorCode, RequestError
from wire.protocol import AdapterSpec, GenerateDelta, GenerateRequest
from wire.sampling import SamplingParams
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService


def first_delta(service: WorkerService, request: GenerateRequest) -> GenerateDelta:
    async def run() -> GenerateDelta:
        deltas = service.generate(request)
        try:
            return await anext(deltas)
        finally:
            await deltas.aclose()  # type: ignore[attr-defined]

    return asyncio.run(run())


def test_an_engine_declares_grammars_and_adapters_up_to_its_limits():
    caps = WorkerCapabilities.of_engine(EngineConfig(model="unused", max_loras=4, max_lora_rank=16))
    assert caps == WorkerCapabilities(structured_output=True, adapters=True, max_loras=4, max_lora_rank=16)
    with pytest.raises(ValueError, match="max_loras"):
        WorkerCapabilities(structured_output=False, adapters=True)


def test_the_null_worker_refuses_the_grammars_and_adapters_it_does_not_declare():
    service = WorkerService(NullLLM(), "null-model", NULL_CAPABILITIES)
    constrained = GenerateRequest("r1", [1, 2], SamplingParams(max_tokens=2, json_schema={"type": "object"}))
    with pytest.raises(RequestError, match="structured output") as refused:
        first_delta(service, constrained)
    assert refused.value.code == ErrorCode.INVALID_REQUEST
    adapted = GenerateRequest("r2", [1, 2], SamplingParams(max_tokens=2),
                              adapter=AdapterSpec("support-bot", "a" * 64, "/nowhere"))
    with pytest.raises(RequestError, match="'support-bot'.*does not support LoRA adapters") as unavailable:
        first_delta(service, adapted)
    assert unavailable.value.code == ErrorCode.ADAPTER_UNAVAILABLE
    served = first_delta(service, GenerateRequest("r3", [1, 2], SamplingParams(max_tokens=2)))
    assert served.samples[0].text == "x"
