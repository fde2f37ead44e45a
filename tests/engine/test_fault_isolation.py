"""A fault in one request's share of a step fails that request alone; the rest get exactly their tokens.

Faults are injected around the real runner of a tiny model: after the real forward (so the failed attempt
has written KV for everyone), after real sampling (so every generator has drawn), or as non-finite logits.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.fault_isolation import EngineFault, sub_plan
from engine.plan import BatchPlan, ModelOutput, SampledToken
from engine.request import Request, RequestStatus
from engine.scheduler import BASE_SLOT, Scheduler
from tests.engine.fake_runner import FakeRunner

NUM = 8
TARGET = "offline-3"  # the LLM numbers its requests; the fourth prompt's request is the one at fault


def prompts(vocab: int) -> list[dict]:
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]} for n in (5, 40, 9, 23, 70, 3, 17, 33)]


def params() -> list[SamplingParams]:
    """Greedy, seeded and unseeded random rows, a penalty and logprobs: every sampler path is in the batch."""
    return [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=2**64 - 1, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
    ]


def make_llm(model_dir) -> LLM:
    # Small budget: the longer prompts prefill in chunks, so faults also hit mid-prefill sequences.
    return LLM(model_dir, num_kv_blocks=96, block_size=4, max_num_batched_tokens=48, dtype="float32")


@pytest.fixture(scope="module")
def reference(llama_dir):
    llm = make_llm(llama_dir)
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate(prompts(vocab), params())
    after = llm.generate({"prompt_token_ids": [9, 8, 7, 6]}, SamplingParams(max_tokens=6, temperature=0.0))
    llm.close()
    return [o.outputs[0].token_ids for o in outs], after[0].outputs[0].token_ids, vocab


def current_plan(engine) -> dict:
    """Records the plan the runner is executing (what a fault hook decides on)."""
    seen: dict = {}
    original = engine.runner.execute

    def execute(plan: BatchPlan) -> ModelOutput:
        seen["plan"] = plan
        return original(plan)

    engine.runner.execute = execute
    return seen


def check_isolated(llm: LLM, reference, outs) -> None:
    tokens, after, _ = reference
    for i, out in enumerate(outs):
        if f"offline-{i}" == TARGET:
            assert out.error == "the engine failed while running this request", out
            assert out.outputs[0].finish_reason == "error"
        else:
            assert out.error is None and out.outputs[0].token_ids == tokens[i], i
    llm.engine.scheduler.check_integrity()
    assert llm.engine.isolator.stats.failed_requests == 1
    # and it keeps serving: a new request gets what a fresh engine gives it
    again = llm.generate({"prompt_token_ids": [9, 8, 7, 6]}, SamplingParams(max_tokens=6, temperature=0.0))
    assert again[0].outputs[0].token_ids == after
    llm.engine.scheduler.check_integrity()
    llm.close()


def test_a_forward_fault_fails_only_its_request(llama_dir, reference):
    llm = make_llm(llama_dir)
    engine = llm.engine
    seen = current_plan(engine)
    forward = engine.runner.model.forward

    def faulty_forward(*args, **kwargs):
        hidden = forward(*args, **kwargs)  # the KV of everyone in the batch is written first
        plan = seen["plan"]
        if engine.scheduler.stats.num_steps >= 4 and any(s.req_id == TARGET for s in plan.seqs):
            raise RuntimeError("Injected fault")
        return hidden

    engine.runner.model.forward = faulty_forward
    outs = llm.generate(prompts(reference[2]), params())
    assert engine.isolator.stats.faulted_steps == 1 and engine.isolator.stats.reruns >= 3
    stats = engine.stats()  # what the worker's /state and /metrics report
    assert (stats.faulted_steps, stats.isolated_failures) == (1, 1)
    check_isolated(llm, reference, outs)


def test_a_sampling_fault_fails_only_its_request(llama_dir, reference):
    llm = make_llm(llama_dir)
    sampler = llm.engine.runner.sampler
    pick = sampler._pick

    def faulty_pick(logits, rows):
        tokens = pick(logits, rows)  # every random row has drawn its noise when the fault hits
        if any(r.req_id == TARGET and len(r.output_token_ids) == 5 for r in rows):
            raise RuntimeError("Injected fault")
        return tokens

    sampler._pick = faulty_pick
    outs = llm.generate(prompts(reference[2]), params())
    check_isolated(llm, reference, outs)


def test_non_finite_logits_fail_only_their_request(llama_dir, reference):
    llm = make_llm(llama_dir)
    engine = llm.engine
    seen = current_plan(engine)
    compute_logits = engine.runner.model.compute_logits

    def poisoned(hidden):
        logits = compute_logits(hidden)
        rows = [r.req_id for r in seen["plan"].sample_rows]
        if TARGET in rows and engine.scheduler.stats.num_steps >= 6:
            logits[rows.index(TARGET), 17] = float("nan")
        return logits

    engine.runner.model.compute_logits = poisoned
    outs = llm.generate(prompts(reference[2]), params())
    assert engine.isolator.stats.reruns == 0  # attributed from the logits: nothing ran twice
    check_isolated(llm, reference, outs)


def test_a_fault_no_request_explains_raises(llama_dir, reference):
    llm = make_llm(llama_dir)
    engine = llm.engine
    seen = current_plan(engine)
    forward = engine.runner.model.forward

    def batch_only_fault(*args, **kwargs):
        if len(seen["plan"].seqs) == NUM:  # every part of the batch runs; the whole never does
            raise RuntimeError("Injected fault")
        return forward(*args, **kwargs)

    engine.runner.model.forward = batch_only_fault
    with pytest.raises(EngineFault, match="cannot be attributed"):
        llm.generate(prompts(reference[2]), params())
    llm.close()


def test_a_batch_out_of_device_memory_runs_in_halves(llama_dir, reference):
    llm = make_llm(llama_dir)
    engine = llm.engine
    seen = current_plan(engine)
    forward = engine.runner.model.forward

    def small_memory(*args, **kwargs):
        if len(seen["plan"].seqs) > NUM // 2:
            raise torch.OutOfMemoryError("Injected: CUDA out of memory")
        return forward(*args, **kwargs)

    engine.runner.model.forward = small_memory
    outs = llm.generate(prompts(reference[2]), params())
    assert [o.outputs[0].token_ids for o in outs] == reference[0] and all(o.error is None for o in outs)
    assert engine.isolator.stats.faulted_steps > 0 and engine.isolator.stats.failed_requests == 0
    engine.scheduler.check_integrity()
    llm.close()


def test_every_request_failing_alone_is_the_engines_fault(llama_dir, reference):
    llm = make_llm(llama_dir)
    engine = llm.engine

    def broken(*args, **kwargs):
        raise RuntimeError("Injected fault: the device is gone")

    engine.runner.model.forward = broken
    with pytest.raises(EngineFault, match="every one of the"):
        llm.generate(prompts(reference[2])[:3], params()[:3])
    llm.close()


def test_sub_plans_keep_kv_slots_and_reindex_rows():
    sched = Scheduler(_config(), num_blocks=32, max_model_len=256)
    for i, n in enumerate((5, 3, 9)):
        sched.add_request(Request(f"r{i}", list(range(100 * i, 100 * i + n)), SamplingParams(max_tokens=4)))
    plan = sched.schedule()
    part = sub_plan(plan, [plan.seqs[0], plan.seqs[2]])
    assert [s.req_id for s in part.seqs] == ["r0", "r2"]
    assert part.token_ids == plan.token_ids[:5] + plan.token_ids[8:]
    assert part.slot_mapping == plan.slot_mapping[:5] + plan.slot_mapping[8:]
    assert part.positions == plan.positions[:5] + plan.positions[8:]
    assert [(s.query_start, s.query_len) for s in part.seqs] == [(0, 5), (5, 9)]
    assert [r.token_index for r in part.sample_rows] == [4, 13]
    assert [part.token_ids[r.token_index] for r in part.sample_rows] == [4, 208]  # r0 and r2 last prompt tokens


def test_a_gate_that_raises_fails_that_request_and_admits_the_rest():
    def gate(req: Request, active: set[int]) -> int | None:
        if req.request_id == "bad":
            raise RuntimeError("slot write overflowed")
        return BASE_SLOT

    released = []
    sched = Scheduler(_config(), num_blocks=32, max_model_len=256, gates=(gate,), on_release=released.append)
    for rid in ("a", "bad", "b"):
        sched.add_request(Request(rid, [11, 12, 13], SamplingParams(max_tokens=2)))
    plan = sched.schedule()
    assert [s.req_id for s in plan.seqs] == ["a", "b"]
    (fault,) = sched.take_admission_faults()
    assert fault[0] == "bad" and fault[1] is gate and "overflowed" in str(fault[2])
    assert [r.request_id for r in released] == ["bad"] and released[0].status == RequestStatus.FINISHED_ERROR
    assert sched.take_admission_faults() == []
    sched.update(plan, FakeRunner().execute(plan))
    sched.check_integrity()


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_ABORTED])
def test_a_failed_request_leaves_nothing_more_in_the_prefix_cache(status):
    sched = Scheduler(_config(), num_blocks=32, max_model_len=256)
    sched.add_request(Request("x", list(range(10, 20)), SamplingParams(max_tokens=8, ignore_eos=True)))
    for _ in range(4):  # prefill (10 tokens: two whole blocks cached), then decodes that fill a third block
        plan = sched.schedule()
        sched.update(plan, ModelOutput([SampledToken(5)]))
    assert sched.kv.prefix_cache.num_blocks == 2
    sched.finish_request("x", status)
    # an abort caches its third computed block; an error caches nothing more (its KV may be what failed)
    assert sched.kv.prefix_cache.num_blocks == (2 if status == RequestStatus.FINISHED_ERROR else 3)
    sched.check_integrity()


def test_sampler_restore_replays_the_same_noise():
    from engine.plan import SampleRow
    from engine.sampler import Sampler

    sampler = Sampler(50, "cpu", seed=3)
    rows = [SampleRow(rid, i, SamplingParams(temperature=1.0, seed=seed), [1], [], (), seed)
            for i, (rid, seed) in enumerate((("a", 9), ("b", None)))]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    snap = sampler.snapshot(["a", "b"])
    first = [s.token_id for s in sampler(logits, rows)]
    second_draw = [s.token_id for s in sampler(logits, rows)]
    sampler.restore(snap)
    assert first != second_draw  # the generators did advance
    assert [s.token_id for s in sampler(logits, rows)] == first
    assert [s.token_id for s in sampler(logits, rows)] == second_draw
    # an unseeded request's noise depends on the engine's seed and its id, not on what else ran
    other = Sampler(50, "cpu", seed=3)
    assert [s.token_id for s in other(logits[1:], rows[1:])] == first[1:]


def _config() -> EngineConfig:
    return EngineConfig(model="unused", block_size=4, max_num_batched_tokens=64)


def test_an_unattributable_fault_fails_everything_in_flight_and_calls_on_fatal(llama_dir):
    import asyncio

    from engine.async_llm import AsyncLLM
    from wire.errors import ErrorCode, RequestError

    fatal: list[BaseException] = []
    llm = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=64, block_size=4), on_fatal=fatal.append)
    seen = current_plan(llm.engine)
    forward = llm.engine.runner.model.forward

    def together_only(*args, **kwargs):  # fails the pair, never either alone: nobody to blame
        if len(seen["plan"].seqs) >= 2:
            raise RuntimeError("Injected fault")
        return forward(*args, **kwargs)

    llm.engine.runner.model.forward = together_only
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def one(rid):
        try:
            return [d async for d in llm.generate(rid, {"prompt_token_ids": [5, 6, 7, 8]}, params)]
        except RequestError as e:
            return e

    async def main():
        return await asyncio.gather(one("a"), one("b"))

    results = asyncio.run(main())
    assert all(isinstance(r, RequestError) and r.code is ErrorCode.ENGINE_ERROR for r in results), results
    # on_fatal runs on the loop thread just after the streams were failed: give it the moment it needs
    deadline = time.monotonic() + 10
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fatal) == 1 and isinstance(fatal[0], EngineFault) and llm.fatal_error is fatal[0]
    late = asyncio.run(one("c"))  # the loop has stopped: nothing new is taken (the worker restarts)
    assert isinstance(late, RequestError) and late.code is ErrorCode.WORKER_UNAVAILABLE
    llm.engine.scheduler.check_integrity()
    llm.shutdown()
