"""The streaming entry point: deltas, abort on early exit, fault isolation, errors with stable codes."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import SamplingParams
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from wire.errors import ErrorCode, RequestError


@pytest.fixture()
def engine(llama_dir):
    eng = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=64, block_size=4))
    yield eng
    eng.shutdown()


async def collect(engine, rid, prompt, params):
    return [o async for o in engine.generate(rid, prompt, params)]


def test_streamed_deltas_add_up_to_the_final_text(engine):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", f"hello {i} 日本語", params) for i in range(4)))

    for outs in asyncio.run(main()):
        final = outs[-1]
        assert final.finished and final.samples[0].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        token_ids = [t for o in outs for s in o.samples for t in s.token_ids]
        assert len(token_ids) == 20 and all(len(s.token_ids) <= 1 for o in outs for s in o.samples)
        assert "".join(s.text for o in outs for s in o.samples) == engine.tokenizer.decode(token_ids)


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        gen = engine.generate("long", "the model serves many tenants", params)
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not engine.engine.has_unfinished_requests():
                return True
        return False

    assert asyncio.run(main())
    stats = engine.stats()
    assert stats.num_running == 0
    engine.engine.scheduler.check_integrity()


def test_refused_request_raises_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(RequestError, match="outside the vocabulary") as info:
            await collect(engine, "bad", {"prompt_token_ids": [10**7]}, SamplingParams(max_tokens=2))
        assert info.value.code is ErrorCode.INVALID_REQUEST and info.value.request_id == "bad"
        return await collect(engine, "good", "hi", SamplingParams(max_tokens=2, ignore_eos=True))

    assert asyncio.run(main())[-1].finished


def test_step_fault_fails_requests_and_releases_everything(engine):
    original = engine.engine.runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return original(plan)

    engine.engine.runner.execute = flaky
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    async def main():
        with pytest.raises(RequestError) as failed:
            await collect(engine, "a", "hello world", params)
        second = await collect(engine, "b", "hello world", params)
        return failed.value, second

    error, second = asyncio.run(main())
    assert error.code is ErrorCode.ENGINE_ERROR and error.request_id == "a"
    assert "device fell over" not in error.message and "RuntimeError" not in error.message  # logged, not shown
    assert second[-1].samples[0].finish_reason == "length"
    engine.engine.scheduler.check_integrity()
    for _ in range(200):  # the loop checks integrity itself once it is idle
        if engine.loop.idle_checked:
            break
        time.sleep(0.01)
    assert engine.loop.idle_checked and engine.integrity_failures == 0
