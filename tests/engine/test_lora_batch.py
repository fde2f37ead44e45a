"""One forward pass serves many adapters and the base model at once, and matches peft running each alone."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.lora_peft import ALL_PROJECTIONS, load_hf_base, make_peft_adapter, random_prompts

pytest.importorskip("peft")

ADAPTER_KINDS = {
    "r4-all": dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS),
    "r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_PROJECTIONS),
    "r16-qv": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "r64-mlp-attn": dict(r=64, lora_alpha=32, target_modules=ALL_PROJECTIONS,
                         rank_pattern={"down_proj": 12}, alpha_pattern={"o_proj": 7}),
}


@pytest.fixture(scope="module")
def four_adapters(make_model, tmp_path_factory):
    model_dir = make_model("llama")
    base = load_hf_base(model_dir)
    root = tmp_path_factory.mktemp("lora-batch")
    refs = {name: make_peft_adapter(base, root / name, seed=i + 1, **kw)
            for i, (name, kw) in enumerate(ADAPTER_KINDS.items())}
    return model_dir, base, refs


def test_mixed_batch_of_four_adapters_and_base_equals_peft_alone(four_adapters):
    model_dir, base, refs = four_adapters
    llm = LLM(model_dir, num_kv_blocks=96, max_loras=4, max_lora_rank=64, max_num_batched_tokens=256)
    for name, ref in refs.items():
        llm.load_adapter(name, ref.path)
    names = list(refs)
    adapters = [names[i % 4] for i in range(10)] + [None, None]  # 12 rows: 4 adapters + base rows
    prompts = random_prompts(llm.engine.model_config.vocab_size, [3, 40, 17, 90, 8, 33, 61, 5, 120, 24, 50, 11])
    max_new = 10
    params = SamplingParams(max_tokens=max_new, temperature=0.0, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)

    eos = llm.tokenizer.eos_token_ids
    base_ref = type(next(iter(refs.values())))(model_dir, base)
    for prompt, adapter, out in zip(prompts, adapters, outs, strict=True):
        reference = refs[adapter] if adapter else base_ref
        want_tokens, want_logprobs = reference.greedy(prompt, max_new, eos)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, f"adapter {adapter}"
        for step, lp in enumerate(got.logprobs):
            for token, value in lp.top:
                assert abs(value - want_logprobs[step][token].item()) <= 1e-4, (adapter, step)
    stats = llm.engine.stats()
    assert stats.lora_slot_loads == 4 and stats.lora_slot_evictions == 0
    llm.engine.scheduler.check_integrity()


def test_prefill_logits_of_each_adapter_match_peft(four_adapters):
    model_dir, _, refs = four_adapters
    llm = LLM(model_dir, num_kv_blocks=64, max_loras=4, max_lora_rank=64)
    prompt = random_prompts(llm.engine.model_config.vocab_size, [70], seed=5)[0]
    base_logits = llm.engine.runner.prefill_logits(prompt)
    for name, ref in refs.items():
        slot = llm.engine.lora.ensure_resident(llm.load_adapter(name, ref.path))
        got = llm.engine.runner.prefill_logits(prompt, lora_slot=slot)
        want = ref.prefill_logits(prompt)
        assert (got - want).abs().max().item() <= 1e-4, name
        assert (got - base_logits).abs().max().item() > 1e-2, f"{name} changes nothing"


def test_adapters_taking_turns_in_one_slot_each_match_peft(four_adapters):
    """One slot, rewritten as adapters take turns in it (q/v only, then every projection, then q/v again):
    each generation matches peft running that adapter. The steps' LoRA operands are kept from step to step
    for the same slots (LoRAStepContext.native_layer_args); a slot write must drop them, or the second
    adapter would run with the first one's groups."""
    model_dir, _, refs = four_adapters
    llm = LLM(model_dir, num_kv_blocks=32, max_loras=1, max_lora_rank=64)
    for name in ("r16-qv", "r4-all"):
        llm.load_adapter(name, refs[name].path)
    prompt = random_prompts(llm.engine.model_config.vocab_size, [21], seed=11)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    eos = llm.tokenizer.eos_token_ids
    for name in ("r16-qv", "r4-all", "r16-qv"):
        out = llm.generate([{"prompt_token_ids": prompt}], params, adapters=[name])[0]
        want, _ = refs[name].greedy(prompt, 6, eos)
        assert out.outputs[0].token_ids == want, name
    assert llm.engine.stats().lora_slot_loads == 3


def test_bf16_mixed_batch_stays_close_to_fp32(four_adapters):
    model_dir, _, refs = four_adapters
    prompts = random_prompts(1000, [30, 12, 45, 7], seed=9)
    adapters = ["r4-all", None, "r16-qv", "r64-mlp-attn"]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3)
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model_dir, dtype=dtype, num_kv_blocks=32, max_loras=4, max_lora_rank=64)
        for name in set(a for a in adapters if a):
            llm.load_adapter(name, refs[name].path)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
        results[dtype] = torch.tensor([[v for _, v in o.outputs[0].logprobs[0].top] for o in outs])
    assert (results["float32"] - results["bfloat16"]).abs().max().item() < 0.15


@pytest.mark.parametrize(("dtype", "tiles"), [("float32", "avx512"), ("bfloat16", "avx512"), ("bfloat16", "amx")])
def test_the_native_layer_adds_the_same_lora_deltas_as_op_by_op(four_adapters, dtype, tiles):
    """All-decode steps with adapters run each layer as one native call (layer_forward, its LoRA adds
    included; gate/up's deltas added inside the fused silu_linear product, on AMX tiles where they run):
    the same logprobs, to the bit, as the Python layer loop on the same mixed batch."""
    from kernels import native_cpu

    ops = native_cpu.ops()
    if ops is None or not ops.has_f32_linear():
        pytest.skip("the native layer needs the AVX-512 panels")
    if dtype == "bfloat16" and not ops.has_bf16_linear():
        pytest.skip("bf16 panels need avx512_bf16")
    if tiles == "amx" and not ops.has_amx():
        pytest.skip("this CPU (or its OS) has no AMX tiles")
    ops.set_amx(tiles == "amx")
    try:
        _native_layer_against_op_by_op(four_adapters, dtype)
    finally:
        ops.set_amx(True)


def _native_layer_against_op_by_op(four_adapters, dtype):
    model_dir, _, refs = four_adapters
    names = list(refs)
    adapters = [names[i % 4] for i in range(6)] + [None]
    prompts = random_prompts(600, [3, 40, 17, 9, 8, 33, 21], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    runs = []
    for fused in (True, False):
        llm = LLM(model_dir, dtype=dtype, num_kv_blocks=96, max_loras=4, max_lora_rank=64,
                  max_num_batched_tokens=256)
        for name, ref in refs.items():
            llm.load_adapter(name, ref.path)
        model = llm.engine.runner.model
        calls: list[int] = []

        def counted(op, calls=calls):
            def call(*args):
                calls.append(len(args[-3]))  # the LoRA operands passed (layer_forward and layers_forward alike)
                return op(*args)
            return call

        model._native_layer = counted(model._native_layer) if fused else None
        model._native_layers = counted(model._native_layers) if fused else None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
        runs.append([(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs]) for o in outs])
        assert (fused and any(calls)) or (not fused and not calls)  # adapters went through the native layer
    assert runs[0] == runs[1]
