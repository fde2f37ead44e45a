"""One mixed workload that exercises the prefix cache, constrained decoding and preemption at once, for the
engine variants that must leave all three unchanged (quantized weights, finer KV caches)."""

from __future__ import annotations

import re
from pathlib import Path

from engine import LLM, SamplingParams
from tests.engine.lora_peft import random_prompts


def check_prefix_cache_grammar_and_preemption(model_dir: Path, **engine_args) -> None:
    """Eight requests sharing a cached 48-token prefix, two of them constrained, in a pool small enough to
    preempt. Always: preemptions happened, the prefix was hit, constrained outputs are valid and the
    scheduler's invariants hold. In float32 also: every output equals the request run alone."""
    kwargs = dict(block_size=16, max_num_batched_tokens=256, **engine_args)
    llm = LLM(model_dir, num_kv_blocks=20, **kwargs)
    shared = random_prompts(1000, [48], seed=4)[0]
    tails = random_prompts(1000, [5, 30, 12, 60, 7, 44, 20, 3], seed=5)
    prompts = [shared + t for t in tails]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    params = [greedy] * 6 + [SamplingParams(max_tokens=16, temperature=0.0, regex="(yes|no)-[0-9]{2}"),
                             SamplingParams(max_tokens=16, temperature=0.0, choice=["alpha", "beta", "gamma"])]
    llm.generate([{"prompt_token_ids": shared + [7]}], SamplingParams(max_tokens=1))  # caches the shared prefix
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_hit_tokens >= 48 and outs[0].num_cached_tokens >= 48
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", outs[6].outputs[0].text)
    assert outs[7].outputs[0].text in ("alpha", "beta", "gamma")
    llm.engine.scheduler.check_integrity()
    if engine_args.get("dtype") == "float32":
        alone = LLM(model_dir, num_kv_blocks=64, **kwargs)
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            assert out.outputs[0].token_ids == alone.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0].token_ids
