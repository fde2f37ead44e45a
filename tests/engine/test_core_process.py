"""The engine loop in a child process: the same streams, errors and adapter calls as on a thread; faults
in the child (one no request is to blame for, the child dying) fail every stream and call on_fatal."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.core_process import ProcessAsyncLLM
from engine.fault_isolation import EngineFault
from tests.engine.faults import break_batches_of_two
from tests.engine.lora_peft import load_hf_base, make_peft_adapter, random_prompts
from wire.errors import ErrorCode, RequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def config(model: Path) -> EngineConfig:
    return EngineConfig(model=str(model), num_kv_blocks=64, block_size=4, max_lora_rank=8)


@pytest.fixture(scope="module")
def core(llama_dir):
    fatal: list[BaseException] = []
    llm = ProcessAsyncLLM(config(llama_dir), on_fatal=fatal.append, threads=1)
    llm.fatal_calls = fatal
    yield llm
    llm.shutdown()


async def collect(llm, rid, prompt, params=GREEDY, **kwargs):
    return [d async for d in llm.generate(rid, prompt, params, **kwargs)]


def tokens(deltas) -> list[int]:
    return [t for d in deltas for s in d.samples for t in s.token_ids]


# Run in the child by call_in_loop (module-level: it pickles by name).
def check_integrity(engine) -> int:
    engine.scheduler.check_integrity()
    return len(engine.scheduler.requests)


def test_streams_match_the_thread_loop_token_for_token(core, llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(500, [5, 9, 14, 3], seed=4)]

    async def run(llm):
        return await asyncio.gather(*(collect(llm, f"r{i}", p) for i, p in enumerate(prompts)))

    threaded = AsyncLLM.from_config(config(llama_dir))
    try:
        expected = asyncio.run(run(threaded))
    finally:
        threaded.shutdown()
    got = asyncio.run(run(core))
    assert [tokens(d) for d in got] == [tokens(d) for d in expected]
    for deltas in got:
        assert deltas[-1].finished and deltas[-1].samples[0].finish_reason == "length"
        assert len(tokens(deltas)) == GREEDY.max_tokens
    assert core.pid != os.getpid()


def test_refused_request_raises_with_its_code_and_the_child_serves_on(core):
    async def main():
        with pytest.raises(RequestError, match="outside the vocabulary") as info:
            await collect(core, "bad", {"prompt_token_ids": [10**7]})
        assert info.value.code is ErrorCode.INVALID_REQUEST and info.value.request_id == "bad"
        return await collect(core, "good", {"prompt_token_ids": [5, 6, 7]})

    assert asyncio.run(main())[-1].finished


def test_a_command_that_does_not_pickle_fails_alone(core):
    unpicklable = {"prompt_token_ids": [5, 6, 7], "note": lambda: None}  # the engine reads only the ids

    async def main():
        with pytest.raises(RequestError) as info:  # NOTE: bounded: a command lost on the way would hang
            await asyncio.wait_for(collect(core, "odd", unpicklable), 60)
        with pytest.raises(RuntimeError, match="does not pickle"):
            await asyncio.wait_for(core.call_in_loop(lambda engine: 1), 60)
        return info.value, await collect(core, "after", {"prompt_token_ids": [5, 6, 7]})

    error, after = asyncio.run(main())
    assert error.code is ErrorCode.ENGINE_ERROR and error.request_id == "odd"
    assert after[-1].finished  # the child serves on


def test_leaving_a_stream_aborts_it_in_the_child(core):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        gen = core.generate("long", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(500):
            await asyncio.sleep(0.01)
            if await core.call_in_loop(check_integrity) == 0:
                return True
        return False

    assert asyncio.run(main())
    assert core.stats().num_running == 0


def test_adapters_load_in_the_child_and_errors_come_back(core, llama_dir, tmp_path):
    ref = make_peft_adapter(load_hf_base(llama_dir), tmp_path / "a", seed=2, r=4, lora_alpha=8,
                            target_modules=["q_proj", "v_proj"])

    async def main():
        loaded = await core.load_adapter("a", str(ref.path))
        with pytest.raises(ValueError):
            await core.load_adapter("missing", str(tmp_path / "nowhere"))
        with_adapter = await collect(core, "lora", {"prompt_token_ids": [5, 6, 7, 8]}, adapter=loaded)
        base = await collect(core, "base", {"prompt_token_ids": [5, 6, 7, 8]})
        await core.unload_adapter("a")
        return loaded, with_adapter, base

    loaded, with_adapter, base = asyncio.run(main())
    assert loaded.name == "a"
    assert tokens(with_adapter) != tokens(base)  # the adapter ran, in the child
    assert core.stats().lora_host_loads >= 1


def test_request_errors_keep_their_code_across_processes():
    error = RequestError(ErrorCode.ADAPTER_UNAVAILABLE, "adapter 'x' could not be loaded", param="model",
                         request_id="r1")
    again = pickle.loads(pickle.dumps(error))
    assert (again.code, again.message, again.param, again.request_id) == \
        (error.code, error.message, error.param, error.request_id)


def test_a_bad_checkpoint_fails_the_start_with_the_engines_error(tmp_path):
    with pytest.raises(Exception, match="config.json|not a directory|No such file|does not exist"):
        ProcessAsyncLLM(config(tmp_path / "nothing"), threads=1)


@pytest.mark.slow
def test_an_unattributable_fault_in_the_child_fails_every_stream_and_stops(llama_dir):
    fatal: list[BaseException] = []
    llm = ProcessAsyncLLM(config(llama_dir), on_fatal=fatal.append, threads=1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def one(rid):
        try:
            return await collect(llm, rid, {"prompt_token_ids": [5, 6, 7, 8]}, params)
        except RequestError as e:
            return e

    async def main():
        await llm.call_in_loop(break_batches_of_two)
        return await asyncio.gather(one("a"), one("b"))

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, RequestError) and r.code is ErrorCode.ENGINE_ERROR for r in results), results
        assert "Injected" not in results[0].message
        deadline = time.monotonic() + 10  # the fault notice follows the failed streams' last lines
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fatal) == 1 and isinstance(fatal[0], EngineFault) and llm.fatal_error is fatal[0]
        late = asyncio.run(one("c"))
        assert isinstance(late, RequestError) and late.code is ErrorCode.WORKER_UNAVAILABLE
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_child_that_dies_fails_the_streams_in_flight(llama_dir):
    fatal: list[BaseException] = []
    llm = ProcessAsyncLLM(config(llama_dir), on_fatal=fatal.append, threads=1)
    params = SamplingParams(max_tokens=100_000 // 200, temperature=0.0, ignore_eos=True)

    async def main():
        gen = llm.generate("doomed", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        first = await gen.__anext__()
        os.kill(llm.pid, signal.SIGKILL)
        with pytest.raises(RequestError) as info:
            async for _ in gen:
                pass
        return first, info.value

    try:
        first, error = asyncio.run(main())
        assert not first.finished and error.code is ErrorCode.ENGINE_ERROR
        deadline = time.monotonic() + 10
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(fatal) == 1 and "exit code" in str(fatal[0])
    finally:
        llm.shutdown()
