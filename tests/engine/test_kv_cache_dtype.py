"""The KV cache in a finer dtype than the compute dtype (EngineConfig.kv_cache_dtype): int8 rows with their
scales, or bf16 under float32 compute. The reference is the same model with its cache in the compute dtype.

Over an int8 cache the queries are rounded like the keys too (kernels.attention.scoring_query). Measured on
the tiny random models (16 prompts x 64 greedy tokens of the finer-cache engine, each replayed through the
reference; four families, both dtypes): the reference picks the same token at 1003-1024 of 1024 positions,
and prefill logits differ by at most 0.049 (int8) and 0.014 (bf16 under fp32). Free-running greedy of these
near-flat random models parts at the first near-tie (573-1024 of 1024), so the decode path's choices are
checked position by position instead: each chosen token is within GAP_TOL of the reference's best logit
there (a near-tie at most), and most are its argmax. On a CPU without native bf16 (AVX2: torch emulates bf16
GEMMs, with other sums at decode than at prefill) bf16 compute agrees less, even with itself: the reference
replaying its own greedy tokens picks them at 1007 of 1024 positions, the int8 cache at 985-1012, and every
disagreement measured there was a near-tie (gap <= 0.031, one bf16 logit step).
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.engine.lora_peft import random_prompts
from tests.engine.mixed_workload import check_prefix_cache_grammar_and_preemption

LOGIT_TOL = 0.1
GAP_TOL = 0.05  # how far below the reference's best logit a decoded token's may be
CASES = [("float32", "int8"), ("bfloat16", "int8"), ("float32", "bfloat16")]  # (compute dtype, cache dtype)


@pytest.mark.parametrize(("dtype", "kv"), CASES)
@pytest.mark.parametrize(("family", "overrides"), [("llama", {}), ("qwen3", {}), ("mistral", {"head_dim": 64})],
                         ids=["llama", "qwen3", "mistral-d64"])  # head_dim 16 and 32, and 64 (native prefill)
def test_a_finer_cache_decodes_what_the_reference_would(make_model, family, overrides, dtype, kv) -> None:
    model_dir = make_model(family, **overrides)
    reference = LLM(model_dir, dtype=dtype, num_kv_blocks=256)
    llm = LLM(model_dir, dtype=dtype, num_kv_blocks=256, kv_cache_dtype=kv)
    cache = llm.engine.runner.kv_caches[0][0]
    assert cache.dtype == getattr(torch, kv) and llm.engine.stats().kv_cache_dtype == kv
    prompts = random_prompts(1000, [4 + 3 * i for i in range(16)], seed=2)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    same = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        want = reference.engine.runner.prefill_logits(prompt + tokens)
        chosen = want[len(prompt) - 1 : -1].float()  # (64, vocab): the reference's logits where each was chosen
        picked = torch.tensor(tokens)
        same += int((chosen.argmax(-1) == picked).sum())
        gap = chosen.max(-1).values - chosen.gather(1, picked[:, None])[:, 0]
        assert gap.max().item() <= GAP_TOL, (family, dtype, kv, gap.max().item())
        got = llm.engine.runner.prefill_logits(prompt + tokens)
        assert (got - want).abs().max().item() <= LOGIT_TOL, (family, dtype, kv)
    assert same >= 0.95 * 16 * 64, (family, dtype, kv, same)


@pytest.mark.parametrize(("dtype", "kv"), [("float32", "int8"), ("bfloat16", "int8"), ("float32", "bfloat16")])
def test_prefix_cache_grammar_and_preemption_on_a_finer_cache(make_model, dtype, kv) -> None:
    """Rounding is per slot and head, so a request's cache does not depend on its batch-mates: in fp32 every
    output equals the request run alone. bf16: the engine's invariants and valid constrained outputs."""
    check_prefix_cache_grammar_and_preemption(make_model("mistral", head_dim=64), dtype=dtype, kv_cache_dtype=kv)


def test_the_cache_bytes_shrink_and_more_blocks_fit(make_model) -> None:
    """One block of a layer holds block_size x H_kv rows of head_dim values: 4 bytes each in fp32, 2 in bf16,
    1 plus a 4-byte scale per row in int8. The same memory budget holds that many more blocks."""
    model_dir = make_model("mistral", head_dim=64)
    runs = {kv: LLM(model_dir, dtype="float32", kv_cache_memory_gb=0.01, kv_cache_dtype=kv).engine
            for kv in ("auto", "bfloat16", "int8")}
    row_bytes = {"auto": 64 * 4, "bfloat16": 64 * 2, "int8": 64 + 4}
    for kv, engine in runs.items():
        mc, runner = engine.model_config, engine.runner
        block_bytes = 2 * mc.num_layers * 16 * mc.num_kv_heads * row_bytes[kv]
        assert runner.num_blocks == int(0.01 * (1 << 30)) // block_bytes
        assert engine.stats().kv_cache_bytes == runner.kv_cache_bytes == (runner.num_blocks + 1) * block_bytes
        assert sum(c.numel() * c.element_size() for kc in runner.kv_caches for c in kc) == runner.kv_cache_bytes
    assert runs["auto"].stats().kv_cache_dtype == "float32"


def test_bad_cache_dtypes_are_refused(make_model) -> None:
    model_dir = make_model("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of bfloat16, int8"):
        EngineConfig(model=str(model_dir), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="runs on the CPU path only; use auto on cuda"):
        EngineConfig(model=str(model_dir), device="cuda", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 needs float32 compute, not float16"):
        LLM(model_dir, dtype="float16", kv_cache_dtype="bfloat16", num_kv_blocks=8)
    with pytest.raises(ValueError, match="kv_cache_dtype int8 needs float32 compute or bfloat16, not float16"):
        LLM(model_dir, dtype="float16", kv_cache_dtype="int8", num_kv_blocks=8)
    same = LLM(model_dir, dtype="bfloat16", kv_cache_dtype="bfloat16", num_kv_blocks=8)  # the compute dtype: fine
    assert same.engine.runner.kv_dtype == torch.bfloat16
