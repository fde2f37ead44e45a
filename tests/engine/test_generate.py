"""Continuous batching against transformers: preemption, chunked prefill, seeded sampling, n > 1."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from wire.checkpoint import ModelConfig

transformers = pytest.importorskip("transformers")


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    model = hf_greedy.cache.get(model_dir)
    if model is None:
        model = hf_greedy.cache[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=list(eos_ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


hf_greedy.cache = {}


def test_batch_with_preemption_equals_transformers_alone(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=40, block_size=16, max_num_batched_tokens=512)
    vocab = llm.engine.model_config.vocab_size
    lengths = [1, 300, 7, 150, 64, 33, 280, 12, 99, 200, 2, 45, 250, 17, 128, 80]
    prompts = random_prompts(vocab, lengths)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    eos = llm.tokenizer.eos_token_ids
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 24, eos)
    llm.engine.scheduler.check_integrity()


def test_chunked_prefill_equals_unchunked(llama_dir):
    prompts = random_prompts(600, [5, 90, 130, 33, 64], seed=3)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    chunked = LLM(llama_dir, num_kv_blocks=128, max_num_batched_tokens=32)
    whole = LLM(llama_dir, num_kv_blocks=128, max_num_batched_tokens=4096)
    a = chunked.generate([{"prompt_token_ids": p} for p in prompts], params)
    b = whole.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert chunked.engine.scheduler.stats.num_steps > whole.engine.scheduler.stats.num_steps


def test_seeded_sampling_alone_equals_in_batch(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=128)
    prompts = random_prompts(600, [12, 40, 7, 66, 23, 5, 80, 31], seed=5)
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=0.8, seed=i) for i in range(7)]
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded, *others])
    assert batch[0].outputs[0].token_ids == alone
    # and a different seed gives a different sample (the seed is really used)
    other = llm.generate({"prompt_token_ids": prompts[0]},
                         SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=99))
    assert other[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64)
    out = llm.generate("hello world", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in out.outputs)


def test_priority_runs_first_when_only_one_fits(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, max_num_seqs=1)
    engine = llm.engine
    p = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request("low", "hello world", p, priority=5)
    engine.add_request("high", "hello world", p, priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "low"]


def test_max_tokens_stop_token_and_ignore_eos(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64)
    base = llm.generate("the model", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    toks = base.outputs[0].token_ids
    assert len(toks) == 12 and base.outputs[0].finish_reason == "length"
    stop_tok = toks[4]
    cut = llm.generate("the model", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[stop_tok]))[0].outputs[0]
    assert cut.token_ids == toks[: toks.index(stop_tok) + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_tok


def test_logprobs_are_the_models_distribution(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64)
    prompt = [5, 6, 7, 8, 9]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))[0].outputs[0]
    logits = llm.engine.runner.prefill_logits(prompt)[-1]
    ref = torch.log_softmax(logits, -1)
    lp = out.logprobs[0]
    assert lp.token_id == int(logits.argmax())
    assert abs(lp.logprob - ref[lp.token_id].item()) < 1e-5
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()


def test_bad_prompts_are_refused(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=8, block_size=16, max_model_len=512)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [10**6]})
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        llm.generate({"prompt_token_ids": [5] * 200})
    with pytest.raises(ValueError, match="maximum context is 512"):
        llm.generate({"prompt_token_ids": [5] * 600})
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    assert not llm.engine.has_unfinished_requests()


def test_the_torch_twins_give_the_native_cpu_paths_tokens(llama_dir, monkeypatch):
    """The model with every native CPU op (kernels/native_cpu.py) and with their torch twins, the path a
    GPU or a machine without a compiler runs: the same greedy tokens on a mixed prefill/decode batch."""
    from kernels import native_cpu

    prompts = random_prompts(600, [3, 70, 1, 33, 140, 9], seed=11)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    native = LLM(llama_dir, num_kv_blocks=64, max_num_batched_tokens=64)
    ops = native_cpu.ops()
    if ops is not None and ops.has_f32_linear():  # the suite's CPU dtype is float32
        assert all(layer.qkv.layout == "panels" for layer in native.engine.runner.model.layers)
    want = [o.outputs[0].token_ids for o in native.generate([{"prompt_token_ids": p} for p in prompts], params)]
    monkeypatch.setattr(native_cpu, "available_for", lambda t: None)
    twins = LLM(llama_dir, num_kv_blocks=64, max_num_batched_tokens=64)
    assert not any(getattr(layer.qkv, "layout", None) == "panels" for layer in twins.engine.runner.model.layers)
    got = [o.outputs[0].token_ids for o in twins.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want


@pytest.mark.parametrize(("family", "overrides", "fields"), [
    ("llama", {}, {}),
    ("llama", {}, {"dtype": "bfloat16"}),
    ("llama", {}, {"quantization": "int8"}),
    ("llama", {}, {"quantization": "w8a8"}),
    ("llama", {}, {"quantization": "w4a8", "quantization_group_size": 32}),
    ("mistral", {"extra": {"sliding_window": 8}}, {}),  # windowed decode attention
    ("qwen2", {}, {"dtype": "bfloat16"}),  # q/k/v bias
])
def test_the_native_layer_gives_the_op_by_op_hidden_states_bit_for_bit(make_model, family, overrides, fields):
    """A step runs each layer as one native call (layer_forward) where every projection is in native panels:
    decode rows, prefill chunks, or both in one step. It calls the same ops in the same order as the Python
    layer loop, so every step's hidden states are the loop's bit for bit. A small token budget chunks the
    long prompts, so steps mix a chunk (past the window, for mistral) with other sequences' decodes."""
    from kernels import native_cpu

    ops = native_cpu.ops()
    model_dir = make_model(family, head_dim=64, **overrides)  # a head_dim the native prefill attention takes
    dtype = EngineConfig(model=str(model_dir), **fields).torch_dtype(ModelConfig.from_pretrained(model_dir))
    needs = {"none": ("has_f32_linear", "has_bf16_linear"), "int8": ("has_int8_linear_f32", "has_bf16_linear"),
             "w8a8": ("has_w8a8_linear_f32", "has_w8a8_linear"),
             "w4a8": ("has_w4a8_linear", "has_w4a8_linear")}[fields.get("quantization", "none")]
    if ops is None or not getattr(ops, needs[dtype == torch.bfloat16])() or not ops.has_prefill_attention():
        pytest.skip(f"no native {dtype} panel kernel for {fields.get('quantization', 'dense')} weights here")
    llm = LLM(model_dir, num_kv_blocks=64, max_num_batched_tokens=48, **fields)
    prompts = random_prompts(600, [5, 40, 23, 17, 1, 9, 70, 3], seed=5)
    kinds, _ = _each_step_both_ways(llm, prompts)
    assert set(kinds) == {"mixed", "prefill", "decode"}, kinds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_layer_runs_adapters_in_prefill_and_mixed_steps_bit_for_bit(make_model, tmp_path, dtype):
    """Steps with adapters go native too, prefill chunks included: each layer's LoRA adds inside
    layer_forward (gate/up's in the fused product on AMX tiles), the op-by-op loop's hidden states bit for bit."""
    from kernels import native_cpu
    from tests.engine.lora_peft import ALL_PROJECTIONS, load_hf_base, make_peft_adapter

    ops = native_cpu.ops()
    if ops is None or not ops.has_prefill_attention() or not ops.has_f32_linear() or (
            dtype == "bfloat16" and not ops.has_bf16_linear()):
        pytest.skip(f"no native {dtype} layer here")
    model_dir = make_model("llama", head_dim=64)
    base = load_hf_base(model_dir)
    adapter_kwargs = {"all": dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS),
                      "qv": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])}
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=64, max_num_batched_tokens=48, max_loras=3, max_lora_rank=16)
    for i, (name, kw) in enumerate(adapter_kwargs.items()):
        llm.load_adapter(name, make_peft_adapter(base, tmp_path / name, seed=i + 1, **kw).path)
    prompts = random_prompts(600, [5, 40, 23, 17, 1, 9, 70, 3], seed=7)
    kinds, most_slots = _each_step_both_ways(llm, prompts, adapters=["all", "qv", None, "all", "qv", "all", None, "qv"])
    assert set(kinds) == {"mixed", "prefill", "decode"}, kinds
    assert most_slots == 2  # both adapters in one step


def _each_step_both_ways(llm: LLM, prompts: list[list[int]], adapters: list[str | None] | None = None
                         ) -> tuple[collections.Counter[str], int]:
    """Greedy-generate `prompts`, running every step three ways: all layers in one native call
    (layers_forward), one native call per layer (layer_forward), then op by op (each rewrites the same keys
    and values); asserts equal hidden states in every step and whole outputs. Returns the kinds of steps seen
    ("... op by op" where the native layers did not run) and the most adapter slots one step used."""
    model = llm.engine.runner.model
    native, stack, forward = model._native_layer, model._native_layers, model.forward
    assert native is not None and stack is not None and model._native_prefill
    kinds: collections.Counter[str] = collections.Counter()
    unequal: list[str] = []
    slots = [0]

    def both_ways(input_ids, positions, kv_caches, attn, lora=None):
        calls = []

        def counted(op):
            def call(*args):
                calls.append(op)
                return op(*args)
            return call

        model._native_layer, model._native_layers = counted(native), counted(stack)
        fused = forward(input_ids, positions, kv_caches, attn, lora)
        model._native_layers = None
        per_layer = forward(input_ids, positions, kv_caches, attn, lora)
        model._native_layer = None
        plain = forward(input_ids, positions, kv_caches, attn, lora)
        model._native_layer, model._native_layers = native, stack
        starts = attn.plan.starts
        chunks = sum(starts[i + 1] - starts[i] > 1 for i in range(len(starts) - 1))
        decodes = len(attn.plan.decode_seqs)
        kind = "mixed" if chunks and decodes else "prefill" if chunks else "decode"
        # one stack call, then one call per layer
        ran = calls == [stack] + [native] * len(model.layers)
        kinds[kind + ("" if ran else " op by op")] += 1
        slots.append(0 if lora is None else len(lora.meta.active_slots))
        if not (torch.equal(fused, plain) and torch.equal(per_layer, plain)):  # noted, not raised: the engine
            unequal.append(kind)  # would fail the step's requests
        return fused

    model.forward = both_ways
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
    assert not unequal, f"steps whose hidden states differ: {unequal}"
    assert all(o.error is None and len(o.outputs[0].token_ids) == 14 for o in outs), [o.error for o in outs]
    return kinds, max(slots)
