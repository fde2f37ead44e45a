"""int8/int4 (weight-only), w8a8 and w4a8 at load, and GPTQ checkpoints: the quantized model computes with its
dequantized weights.

The reference of a quantized model is the same model with every quantized weight replaced by its
dequantized value (`LlamaModel.dequantized_state_dict`), run by transformers or by loraplex unquantized;
for w8a8 and w4a8 transformers also rounds every quantized projection's input rows to int8
(quant_reference.with_int8_inputs). Tolerances: fp32 activations compute with exactly those matrices (only
summation order differs; measured max |logit diff| about 2e-6), bf16 activations round activations and
sums (measured up to 0.034 weight-only, 0.077 w8a8: a bf16 rounding can move an int8 rounding by one step).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from demo.checkpoint import FAMILIES
from engine import LLM, SamplingParams
from engine.config import CheckpointError, EngineConfig
from kernels.quant import Int8Weight
from tests.engine.lora_peft import ALL_PROJECTIONS, PeftReference, make_peft_adapter, random_prompts
from tests.engine.mixed_workload import check_prefix_cache_grammar_and_preemption
from tests.engine.quant_reference import (
    hf_with_weights,
    with_int8_inputs,
    write_checkpoint,
    write_gptq_checkpoint,
)

pytest.importorskip("transformers")

LOGIT_TOL = {"float32": 1e-4, "bfloat16": 0.1}
# w8a8 in fp32: an fp32 summation-order difference (1e-6) can move an activation across an int8 rounding
# boundary, one step of max|x| / 127 on one input (measured: logits 0.0000 without adapters, logprobs 0.003
# with them on AMD Zen 3/4; on an Intel Xeon with AMX, one such flip moved one base-model logprob by 0.019,
# every other logprob within 0.009); not rounding activations at all would be 0.04-0.06 off.
W8A8_FP32_TOL = 0.03
METHODS = {"int8": {"quantization": "int8"}, "int4": {"quantization": "int4", "quantization_group_size": 32},
           "w8a8": {"quantization": "w8a8"}, "w4a8": {"quantization": "w4a8", "quantization_group_size": 32}}
INT8_INPUTS = ("w8a8", "w4a8")  # the methods that round activations to int8


def hf_reference(model_dir: Path, llm: LLM, method: str) -> torch.nn.Module:
    """transformers on `llm`'s dequantized weights, reading activations the way `method` does."""
    hf = hf_with_weights(model_dir, llm.engine.runner.model.dequantized_state_dict())
    return with_int8_inputs(hf) if method in INT8_INPUTS else hf


def dequantized_dir(llm: LLM, src: Path, out: Path) -> Path:
    return write_checkpoint(src, llm.engine.runner.model.dequantized_state_dict(), out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_transformers_on_the_dequantized_weights(make_model, family, method, dtype) -> None:
    model_dir = make_model(family)
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=16, **METHODS[method])
    hf = hf_reference(model_dir, llm, method)
    for prompt in random_prompts(1000, [8, 40], seed=1):  # bf16: 8 tokens run the packed kernels, 40 dequantize
        got = llm.engine.runner.prefill_logits(prompt)
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([prompt])).logits[0].float()
        tol = W8A8_FP32_TOL if method in INT8_INPUTS and dtype == "float32" else LOGIT_TOL[dtype]
        assert (got - want).abs().max().item() <= tol, (family, method, dtype, len(prompt))


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_agree_with_the_dequantized_model(make_model, tmp_path, family, method) -> None:
    """16 x 64 greedy tokens. fp32: free-running, >= 99 % (measured 1024/1024 for all eight). bf16: free-running
    greedy of these random models diverges at the first near-tie even unquantized (dense bf16 vs dense fp32:
    520/1024 for llama), so bf16 per-token decisions are compared under teacher forcing: >= 97 % (measured
    1003-1020/1024). w8a8 and w4a8 round activations the dequantized model does not, so they are compared under
    teacher forcing in both dtypes: >= 95 % (measured 991-1017/1024; their exactness is the logits test's,
    against a reference that rounds them too)."""
    model_dir = make_model(family)
    prompts = random_prompts(1000, [4 + 3 * i for i in range(16)], seed=2)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        quantized = LLM(model_dir, dtype=dtype, num_kv_blocks=256, **METHODS[method])
        reference = LLM(dequantized_dir(quantized, model_dir, tmp_path / dtype), dtype=dtype, num_kv_blocks=256)
        want = [o.outputs[0].token_ids for o in reference.generate([{"prompt_token_ids": p} for p in prompts], params)]
        if dtype == "float32" and method not in INT8_INPUTS:
            got = [o.outputs[0].token_ids for o in quantized.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      params)]
            same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
            assert same >= 0.99 * 16 * 64, (family, method, same)
            continue
        same = 0
        for prompt, tokens in zip(prompts, want, strict=True):
            logits = quantized.engine.runner.prefill_logits(prompt + tokens)[len(prompt) - 1 : -1]
            same += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
        assert same >= (0.95 if method in INT8_INPUTS else 0.97) * 16 * 64, (family, method, dtype, same)


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # untied lm_head (quantized) and tied (kept dense)
def test_weight_bytes_count_what_stays_resident(make_model, family) -> None:
    model_dir = make_model(family)
    dense = LLM(model_dir, dtype="bfloat16", num_kv_blocks=8).engine.runner
    mc = dense.model_config
    linears = [(n, k) for k, n in mc.lora_module_shapes().values()] * mc.num_layers  # (out, in)
    if not mc.tie_word_embeddings:
        linears.append((mc.vocab_size, mc.hidden_size))
    linear_params = sum(n * k for n, k in linears)
    assert dense.weight_bytes == 2 * sum(p.numel() for p in dense.model.dequantized_state_dict().values())
    rest = dense.weight_bytes - 2 * linear_params  # embeddings, norms: bf16 either way
    int8 = LLM(model_dir, dtype="bfloat16", num_kv_blocks=8, quantization="int8").engine.runner
    assert int8.dtype == torch.bfloat16
    assert int8.weight_bytes == rest + linear_params + 2 * sum(n for n, _ in linears)
    w8a8 = LLM(model_dir, dtype="bfloat16", num_kv_blocks=8, quantization="w8a8").engine.runner
    assert w8a8.weight_bytes == int8.weight_bytes
    int4 = LLM(model_dir, num_kv_blocks=8, quantization="int4", quantization_group_size=32).engine.runner
    size = int4.dtype.itemsize  # scales and zeros in the activation dtype (float32 where int4 reads float32)
    rest4 = int4.weight_bytes - linear_params // 2 - sum(2 * size * n * (k // 32) for n, k in linears)
    assert rest4 == rest * size // 2  # embeddings and norms: in the activation dtype too
    w4a8 = LLM(model_dir, num_kv_blocks=8, quantization="w4a8", quantization_group_size=32).engine.runner
    assert w4a8.dtype == int4.dtype and w4a8.weight_bytes == int4.weight_bytes


@pytest.mark.parametrize(("method", "dtype"), [("int4", "float32"), ("w4a8", "float32"), ("int8", "bfloat16")])
def test_a_tied_table_held_as_int8_serves_the_lookup_and_the_lm_head(make_model, method, dtype) -> None:
    """--quantize-lm-head: a tied embedding table is one int8 copy (per row), read by the embedding lookup and
    the lm_head; the model then computes exactly with its dequantized weights, embedding included (the
    reference ties its lm_head to that table too). An untied model is left as it is."""
    model_dir = make_model("qwen2")  # tied, with the native layer (no q/k norms)
    plain = LLM(model_dir, dtype=dtype, num_kv_blocks=16, **METHODS[method])
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=16, quantize_lm_head=True, **METHODS[method])
    runner, model = llm.engine.runner, llm.engine.runner.model
    assert isinstance(model.embed, Int8Weight) and model.lm_head is model.embed
    assert runner.quantization is not None and runner.quantization.describe().endswith(", tied lm_head int8")
    mc, size = runner.model_config, runner.dtype.itemsize
    table = mc.vocab_size * mc.hidden_size
    assert runner.weight_bytes == plain.engine.runner.weight_bytes - table * size + table + mc.vocab_size * size
    hf = hf_reference(model_dir, llm, method)
    for prompt in random_prompts(1000, [8, 40], seed=3):
        got = runner.prefill_logits(prompt)
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([prompt])).logits[0].float()
        tol = W8A8_FP32_TOL if method in INT8_INPUTS and dtype == "float32" else LOGIT_TOL[dtype]
        assert (got - want).abs().max().item() <= tol, (method, dtype, len(prompt))
    untied = LLM(make_model("llama"), num_kv_blocks=8, quantize_lm_head=True, **METHODS[method]).engine.runner
    assert untied.quantization is not None and not untied.quantization.tied_table_int8
    assert not isinstance(untied.model.embed, Int8Weight)


# ----- LoRA on a quantized base ---------------------------------------------------------------------------

ADAPTERS = {
    "r4-all": dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS),
    "r8-rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL_PROJECTIONS),
    "r16-qv": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_adapter_rows_on_a_quantized_base_match_peft_on_the_dequantized_base(make_model, tmp_path, method) -> None:
    pytest.importorskip("peft")
    model_dir = make_model("llama")
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=96, max_loras=3, max_lora_rank=16, **METHODS[method])
    base = hf_reference(model_dir, llm, method)
    refs = {name: make_peft_adapter(base, tmp_path / name, seed=i + 1, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    for name, ref in refs.items():
        llm.load_adapter(name, ref.path)
    adapters = [None, "r4-all", "r8-rslora", "r16-qv", "r4-all", None, "r16-qv", "r8-rslora"]
    prompts = random_prompts(1000, [3, 40, 17, 9, 25, 12, 60, 5], seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
    eos = llm.tokenizer.eos_token_ids
    tol = W8A8_FP32_TOL if method in INT8_INPUTS else 1e-4
    for prompt, adapter, out in zip(prompts, adapters, outs, strict=True):
        reference = refs[adapter] if adapter else PeftReference(model_dir, base)
        want_tokens, want_logprobs = reference.greedy(prompt, 8, eos)
        assert out.outputs[0].token_ids == want_tokens, adapter
        for step, lp in enumerate(out.outputs[0].logprobs):
            for token, value in lp.top:
                assert abs(value - want_logprobs[step][token].item()) <= tol, (adapter, step)

    # bf16: the adapters alone move logits by 0.1-0.24 from fp32 peft (r8-rslora, unquantized too, depending on
    # how the CPU LoRA kernel rounds), so the quantized bf16 model is held to the unquantized bf16 model's own
    # error: its distance to peft on its own dequantized base (bf16 scales round to other values) stays within
    # twice the unquantized model's distance to peft on the original base, plus 0.02 (measured: at most 1.5x).
    from peft import PeftModel

    def bf16_errors(engine_kwargs: dict) -> dict[tuple[str, int], float]:
        bf16 = LLM(model_dir, dtype="bfloat16", num_kv_blocks=32, max_loras=3, max_lora_rank=16, **engine_kwargs)
        hf_base = hf_reference(model_dir, bf16, method if engine_kwargs else "none")
        errors = {}
        for name, ref in refs.items():
            slot = bf16.engine.lora.ensure_resident(bf16.load_adapter(name, ref.path))
            want = PeftReference(ref.path, PeftModel.from_pretrained(copy.deepcopy(hf_base), ref.path).eval())
            for prompt in (prompts[1], prompts[3]):  # 40 tokens (dequantized path) and 9 (packed kernels)
                got = bf16.engine.runner.prefill_logits(prompt, lora_slot=slot)
                errors[(name, len(prompt))] = (got - want.prefill_logits(prompt)).abs().max().item()
        return errors

    # w8a8: a bf16 rounding also moves int8 roundings of the activations (measured: at most 2.6x)
    factor = 3 if method in INT8_INPUTS else 2
    dense_errors = bf16_errors({})
    for key, error in bf16_errors(METHODS[method]).items():
        assert error <= factor * dense_errors[key] + 0.02, (key, error, dense_errors[key])


@pytest.mark.parametrize(("method", "dtype"), [("int4", "float32"), ("int8", "bfloat16"), ("w8a8", "bfloat16"),
                                             ("w4a8", "float32")])
def test_prefix_cache_grammar_and_preemption_on_a_quantized_model(make_model, method, dtype) -> None:
    """fp32: every output equals the request run alone; bf16 (batch-dependent kernel choice): the engine's
    own invariants and valid constrained outputs."""
    check_prefix_cache_grammar_and_preemption(make_model("llama"), dtype=dtype, **METHODS[method])


# ----- pre-quantized GPTQ checkpoints ---------------------------------------------------------------------

GPTQ_VARIANTS = {  # family, group size, symmetric, checkpoint format
    "llama-g32-asym-v1": ("llama", 32, False, "gptq"),
    "qwen2-g64-sym-v1": ("qwen2", 64, True, "gptq"),
    "qwen3-per-channel-asym-v2": ("qwen3", -1, False, "gptq_v2"),
}


@pytest.mark.parametrize("variant", list(GPTQ_VARIANTS))
def test_gptq_checkpoint_loads_and_matches_its_dequantization(make_model, tmp_path, variant) -> None:
    family, group, sym, fmt = GPTQ_VARIANTS[variant]
    src = make_model(family)
    reference = write_gptq_checkpoint(src, tmp_path / "gptq", group_size=group, sym=sym, checkpoint_format=fmt)
    dequantized = write_checkpoint(src, reference, tmp_path / "dequantized")

    llm = LLM(tmp_path / "gptq", dtype="float32", num_kv_blocks=16)
    runner = llm.engine.runner
    assert runner.quantization is not None and runner.quantization.source == "gptq"
    loaded = runner.model.dequantized_state_dict()
    for name, want in reference.items():
        assert (loaded[name] - want).abs().max().item() <= 1e-6, name
    dense = LLM(dequantized, dtype="float32", num_kv_blocks=16)
    for prompt in random_prompts(1000, [8, 40], seed=6):
        got, want = runner.prefill_logits(prompt), dense.engine.runner.prefill_logits(prompt)
        assert (got - want).abs().max().item() <= LOGIT_TOL["float32"], len(prompt)
        assert llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0.0))[0] \
            .outputs[0].token_ids == dense.generate([{"prompt_token_ids": prompt}],
                                                    SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].token_ids

    # CPU + GPTQ: bf16 activations, or float32 where the CPU has no native bf16 and the AVX2 int4 kernel is built
    auto = LLM(tmp_path / "gptq", num_kv_blocks=16, quantization="int4")
    want_dtype = torch.float32 if _int4_reads_float32() else torch.bfloat16
    assert auto.engine.runner.dtype == want_dtype
    prompt = random_prompts(1000, [8], seed=7)[0]
    got = auto.engine.runner.prefill_logits(prompt)
    assert (got - dense.engine.runner.prefill_logits(prompt)).abs().max().item() <= \
        LOGIT_TOL[str(want_dtype).removeprefix("torch.")]


def _int4_reads_float32() -> bool:
    """Whether dtype="auto" computes an int4 model in float32 on this machine (EngineConfig.torch_dtype)."""
    from kernels import native_cpu
    from kernels.cpu_features import default_cpu_dtype

    ops = native_cpu.ops()
    return default_cpu_dtype() is torch.float32 and ops is not None and bool(ops.has_int4_linear_f32())


REFUSED = {  # quantization_config overrides (or a g_idx permutation) -> what the one-line error names
    "bits-8": ({"bits": 8}, "bits=8"),
    "awq": ({"quant_method": "awq"}, "quant_method 'awq'"),
    "marlin-format": ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    "quantized-lm-head": ({"lm_head": True}, "lm_head"),
    "group-16": ({"group_size": 16}, "group_size 16"),
    "dynamic": ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    "act-order": (None, "act-order"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_gptq_variants_are_refused_with_one_line(make_model, tmp_path, case) -> None:
    overrides, phrase = REFUSED[case]
    write_gptq_checkpoint(make_model("llama"), tmp_path / "gptq", quantization_config=overrides,
                          permuted_g_idx=overrides is None)
    with pytest.raises(CheckpointError) as info:
        LLM(tmp_path / "gptq", num_kv_blocks=8)
    assert phrase in str(info.value) and "\n" not in str(info.value)


def test_bad_quantization_settings_are_refused(make_model, tmp_path) -> None:
    src = make_model("llama")
    write_gptq_checkpoint(src, tmp_path / "gptq", group_size=32)
    for kwargs, phrase in (({"quantization": "int8"}, "cannot run as int8"),
                           ({"quantization": "int4", "quantization_group_size": 64}, "has group size 32, not 64")):
        with pytest.raises(CheckpointError, match=phrase):
            LLM(tmp_path / "gptq", num_kv_blocks=8, **kwargs)
    with pytest.raises(CheckpointError, match="int4 group size 128 does not divide in_features 64"):
        LLM(src, num_kv_blocks=8, quantization="int4", quantization_group_size=128)
    with pytest.raises(CheckpointError, match="--quantize-lm-head needs --quantization"):
        LLM(src, num_kv_blocks=8, quantize_lm_head=True)
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4"):
        EngineConfig(model=str(src), quantization="int3")
    for method in ("int8", "w8a8"):
        with pytest.raises(ValueError, match="applies to int4 and w4a8 only"):
            EngineConfig(model=str(src), quantization=method, quantization_group_size=32)
    # a GPTQ checkpoint runs as w4a8 when asked: its 4-bit weights, the inputs rounded to int8
    w4a8 = LLM(tmp_path / "gptq", num_kv_blocks=8, quantization="w4a8", quantization_group_size=32).engine.runner
    assert w4a8.quantization is not None and w4a8.quantization.describe() == "w4a8, group size 32 (GPTQ checkpoint)"
    projections = [w for layer in w4a8.model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert {(type(w).__name__, w.activations) for w in projections} == {("Int4Weight", "int8")}
    default = LLM(src, num_kv_blocks=8, quantization="int4").engine.runner.quantization
    assert default is not None and default.group_size == 64  # 128 does not divide hidden 64: the next one
