"""Device slots and the host cache under churn: LRU eviction, pinning, unload and replace in flight."""

from __future__ import annotations

import shutil

import pytest

from engine import LLM, SamplingParams
from tests.engine.lora_peft import ALL_PROJECTIONS, load_hf_base, make_peft_adapter, random_prompts
from wire.protocol import GenerateDelta

pytest.importorskip("peft")

MAX_NEW = 6


@pytest.fixture(scope="module")
def ten_adapters(make_model, tmp_path_factory):
    model_dir = make_model("llama")
    base = load_hf_base(model_dir)
    root = tmp_path_factory.mktemp("lora-slots")
    ranks = [2, 4, 8, 16, 4, 8, 2, 16, 8, 4]
    refs = {
        f"a{i}": make_peft_adapter(base, root / f"a{i}", seed=100 + i, r=r, lora_alpha=2 * r,
                                   target_modules=ALL_PROJECTIONS if i % 2 else ["q_proj", "v_proj", "down_proj"])
        for i, r in enumerate(ranks)
    }
    return model_dir, refs


def collect(step_outputs: list, tokens: dict[str, list[int]]) -> list[str]:
    """Add a step's new tokens to `tokens` (request id -> its token ids); returns the ids that finished."""
    finished = []
    for out in step_outputs:
        assert isinstance(out, GenerateDelta), out
        tokens.setdefault(out.request_id, []).extend(t for s in out.samples for t in s.token_ids)
        if out.finished:
            finished.append(out.request_id)
    return finished


def expected_tokens(refs, adapter, prompt, eos):
    return refs[adapter].greedy(prompt, MAX_NEW, eos)[0]


def test_ten_adapters_over_three_slots_with_a_pinned_one(ten_adapters):
    model_dir, refs = ten_adapters
    llm = LLM(model_dir, num_kv_blocks=64, max_loras=3, max_lora_rank=16, max_cpu_loras=4,
              max_num_seqs=8, max_num_batched_tokens=128)
    engine = llm.engine
    for name, ref in refs.items():
        llm.load_adapter(name, ref.path)
    llm.pin_adapter("a4")
    llm.pin_adapter("a5")
    with pytest.raises(ValueError, match="one slot must stay free"):
        llm.pin_adapter("a6")  # 2 of 3 slots pinned: the last stays free
    llm.pin_adapter("a4", False)
    llm.pin_adapter("a5", False)
    llm.pin_adapter("a3")

    names = list(refs)
    adapters = [names[(i * 7) % 10] for i in range(22)] + ["a3", None, "a3", None]
    prompts = random_prompts(engine.model_config.vocab_size, [5 + (i * 13) % 40 for i in range(len(adapters))], 2)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, adapter=adapter)
    tokens: dict[str, list[int]] = {}
    pinned_slot = None
    while engine.has_unfinished_requests():
        collect(engine.step(), tokens)
        engine.wait_for_adapter_loads(0.05)
        slot_of = {ref.name: slot for ref, slot in engine.lora._slot_of.items()}
        if pinned_slot is None:
            pinned_slot = slot_of.get("a3")
        else:
            assert slot_of.get("a3") == pinned_slot, "the pinned adapter left its slot"
        engine.scheduler.check_integrity()

    eos = llm.tokenizer.eos_token_ids
    base_ref = type(refs["a0"])(model_dir, load_hf_base(model_dir))
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        want = expected_tokens(refs, adapter, prompt, eos) if adapter else base_ref.greedy(prompt, MAX_NEW, eos)[0]
        assert tokens[f"r{i}"] == want, f"request r{i} on {adapter}"
    stats = engine.stats()
    assert stats.lora_slot_loads >= 10 and stats.lora_slot_evictions >= 7
    assert stats.lora_slot_loads == stats.lora_slot_evictions + len(stats.lora_resident_adapters)
    assert stats.lora_host_loads > 10 and stats.lora_host_evictions >= 6  # 4 host entries for 10 adapters
    assert "a3" in stats.lora_resident_adapters
    assert engine.lora.host.num_resident() <= 4


def test_at_most_max_loras_distinct_adapters_per_step(ten_adapters):
    model_dir, refs = ten_adapters
    llm = LLM(model_dir, num_kv_blocks=64, max_loras=3, max_lora_rank=16)
    engine = llm.engine
    for name in ("a0", "a1", "a2", "a5", "a6"):
        llm.load_adapter(name, refs[name].path)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(engine.model_config.vocab_size, [9] * 10, 4)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, adapter=["a0", "a1", "a2", "a5", "a6"][i % 5])
    seen_waiting = False
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        assert len({s.lora_slot for s in plan.seqs} - {-1}) <= 3
        seen_waiting |= len(engine.scheduler.waiting) > 0 and bool(plan.seqs)
        engine._make_outputs(engine.scheduler.update(plan, engine.runner.execute(plan)))
    assert seen_waiting  # two adapters had to wait for a slot while the others ran
    engine.scheduler.check_integrity()


def test_unload_with_requests_in_flight_lets_them_finish_and_refuses_new_ones(ten_adapters):
    model_dir, refs = ten_adapters
    llm = LLM(model_dir, num_kv_blocks=64, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    llm.load_adapter("a1", refs["a1"].path)
    prompts = random_prompts(engine.model_config.vocab_size, [20, 31, 12], 6)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, adapter="a1")
    tokens: dict[str, list[int]] = {}
    collect(engine.step(), tokens)
    llm.unload_adapter("a1")
    with pytest.raises(ValueError, match="'a1' is not loaded"):
        engine.add_request("late", {"prompt_token_ids": prompts[0]}, params, adapter="a1")
    with pytest.raises(ValueError, match="'a1' is not loaded"):
        llm.unload_adapter("a1")
    while engine.has_unfinished_requests():
        collect(engine.step(), tokens)
    eos = llm.tokenizer.eos_token_ids
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == expected_tokens(refs, "a1", prompt, eos)
    engine.scheduler.check_integrity()
    assert engine.lora.host.num_resident() == 0 and engine.lora.host.users() == {}


def test_new_content_under_a_name_serves_new_requests_while_old_ones_finish(ten_adapters, tmp_path):
    model_dir, refs = ten_adapters
    llm = LLM(model_dir, num_kv_blocks=64, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    old_ref = llm.load_adapter("x", refs["a2"].path)
    assert llm.load_adapter("x", refs["a2"].path) == old_ref  # idempotent
    prompt = random_prompts(engine.model_config.vocab_size, [25], 7)[0]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    engine.add_request("old", {"prompt_token_ids": prompt}, params, adapter="x")
    tokens: dict[str, list[int]] = {}
    collect(engine.step(), tokens)
    new_ref = llm.load_adapter("x", refs["a5"].path)
    assert new_ref.name == "x" and new_ref.sha256 != old_ref.sha256
    with pytest.raises(ValueError, match="no longer loaded"):
        engine.add_request("stale", {"prompt_token_ids": prompt}, params, adapter=old_ref)
    engine.add_request("new", {"prompt_token_ids": prompt}, params, adapter=new_ref)
    while engine.has_unfinished_requests():
        collect(engine.step(), tokens)
    eos = llm.tokenizer.eos_token_ids
    assert tokens["old"] == expected_tokens(refs, "a2", prompt, eos)
    assert tokens["new"] == expected_tokens(refs, "a5", prompt, eos)
    engine.scheduler.check_integrity()
    assert engine.lora.host.registered() == {"x": new_ref}


def test_adapter_reloaded_from_disk_just_in_time_or_failed_clearly(ten_adapters, tmp_path):
    model_dir, refs = ten_adapters
    llm = LLM(model_dir, num_kv_blocks=64, max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    engine = llm.engine
    moved = tmp_path / "a7"
    shutil.copytree(refs["a7"].path, moved)
    llm.load_adapter("a7", moved)
    llm.load_adapter("a8", refs["a8"].path)  # evicts a7 from host memory
    assert engine.stats().lora_host_evictions == 1
    prompt = random_prompts(engine.model_config.vocab_size, [14], 8)[0]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": prompt}], params, adapters=["a7"])[0]
    eos = llm.tokenizer.eos_token_ids
    assert out.outputs[0].token_ids == expected_tokens(refs, "a7", prompt, eos)
    assert engine.stats().lora_host_loads == 3

    llm.generate([{"prompt_token_ids": prompt}], params, adapters=["a8"])  # a7 leaves host memory again
    shutil.rmtree(moved)
    out, base = llm.generate([{"prompt_token_ids": prompt}] * 2, params, adapters=["a7", None])
    assert out.outputs[0].finish_reason == "error"
    assert "could not be reloaded" in (out.error or "") and "a7" in out.error
    assert base.outputs[0].finish_reason in ("stop", "length")
    engine.scheduler.check_integrity()
    assert engine.lora.host.users() == {}


def test_preempted_requests_resume_in_their_slot_with_correct_outputs(ten_adapters):
    model_dir, refs = ten_adapters
    llm = LLM(model_dir, num_kv_blocks=10, block_size=16, max_loras=2, max_lora_rank=16,
              max_num_batched_tokens=256)
    for name in ("a1", "a2"):
        llm.load_adapter(name, refs[name].path)
    # The prompts fill all 10 blocks exactly: the first decode step must preempt.
    prompts = random_prompts(llm.engine.model_config.vocab_size, [32, 48, 32, 48], 11)
    adapters = ["a1", "a2", None, "a1"]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    eos = llm.tokenizer.eos_token_ids
    base_ref = type(refs["a0"])(model_dir, load_hf_base(model_dir))
    for prompt, adapter, out in zip(prompts, adapters, outs, strict=True):
        reference = refs[adapter] if adapter else base_ref
        assert out.outputs[0].token_ids == reference.greedy(prompt, MAX_NEW, eos)[0]
    assert llm.engine.stats().lora_slot_evictions == 0
    llm.engine.scheduler.check_integrity()


def test_a_request_waiting_for_a_slot_is_not_starved_by_resident_adapters(ten_adapters):
    model_dir, refs = ten_adapters
    llm = LLM(model_dir, num_kv_blocks=256, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    for name in ("a0", "a1", "a2"):
        llm.load_adapter(name, refs[name].path)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    prompts = iter(random_prompts(vocab, [7] * 400, 9))
    for i in range(4):
        engine.add_request(f"busy{i}", {"prompt_token_ids": next(prompts)}, params, adapter=f"a{i % 2}")
    engine.step()  # a0 and a1 now hold both slots
    engine.add_request("late", {"prompt_token_ids": next(prompts)}, params, adapter="a2")
    finished_late = False
    for step in range(60):  # a steady stream of new work for the resident adapters
        engine.add_request(f"more{step}", {"prompt_token_ids": next(prompts)}, params, adapter=f"a{step % 2}")
        finished_late |= "late" in collect(engine.step(), {})
        if finished_late:
            break
    assert finished_late, "the a2 request never got a slot"
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.check_integrity()
