"""Bucketed decode (engine.decode_graph) gives the plain path's tokens at every batch size.

The buckets pad a decode step up to 1, 2, 4, 8, 16, 24 or 32 rows over persistent inputs (the structure
CUDA graphs replay on a GPU; on the CPU the same buffers run eagerly). Pad rows must change nothing a real
row computes: greedy tokens and their logprobs equal the plain path's for batches of 1..32 (sizes between
buckets included), with and without adapters, and the KV pool stays consistent.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decode_graph import bucket_sizes
from tests.engine.lora_peft import ALL_PROJECTIONS, load_hf_base, make_peft_adapter, random_prompts

MAX_NEW = 12
# 16 prompts; lengths put sequences on both sides of a 16-token block boundary while they decode
PROMPT_LENGTHS = [1, 5, 15, 16, 17, 30, 9, 40, 3, 22, 12, 7, 33, 2, 28, 14]


def test_bucket_sizes():
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_sizes(12) == (1, 2, 4, 8, 12)
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(3) == (1, 2, 3)


def _engine(model_dir, graphs: bool) -> LLM:
    return LLM(model_dir, num_kv_blocks=160, max_num_seqs=32, decode_graphs=graphs, max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def engines(llama_dir):
    return _engine(llama_dir, True), _engine(llama_dir, False)


def _run(llm: LLM, prompts, adapters=None):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=adapters)
    return [(o.outputs[0].token_ids, [[(t, round(v, 4)) for t, v in lp.top] for lp in o.outputs[0].logprobs])
            for o in outs]


def test_every_batch_size_gives_the_plain_paths_tokens(engines):
    bucketed, plain = engines
    prompts16 = random_prompts(bucketed.engine.model_config.vocab_size, PROMPT_LENGTHS, seed=7)
    for size in range(1, 33):
        prompts = [prompts16[i % 16] for i in range(size)]
        got, want = _run(bucketed, prompts), _run(plain, prompts)
        assert [g[0] for g in got] == [w[0] for w in want], f"batch size {size}"
        assert got == want, f"batch size {size}: logprobs"
    graphs = bucketed.engine.runner.decode_graphs
    assert graphs is not None and plain.engine.runner.decode_graphs is None
    # every size ran through a bucket: (MAX_NEW - 1) decode steps each, pad rows up to the bucket
    assert graphs.stats.steps >= 32 * (MAX_NEW - 1)
    assert graphs.stats.padded_rows > 0
    bucketed.engine.scheduler.check_integrity()


def test_adapters_in_a_bucket_give_the_plain_paths_tokens(make_model, tmp_path_factory):
    model_dir = make_model("llama")
    base = load_hf_base(model_dir)
    root = tmp_path_factory.mktemp("decode-graph-lora")
    refs = [make_peft_adapter(base, root / f"a{i}", seed=i + 1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)
            for i in range(2)]
    bucketed, plain = _engine(model_dir, True), _engine(model_dir, False)
    for llm in (bucketed, plain):
        for i, ref in enumerate(refs):
            llm.load_adapter(f"a{i}", ref.path)
    prompts = random_prompts(bucketed.engine.model_config.vocab_size, PROMPT_LENGTHS[:11], seed=3)
    adapters = ["a0", None, "a1", "a0", "a1", None, "a0", "a1", None, "a0", "a1"]  # 11 rows: bucket 16
    assert _run(bucketed, prompts, adapters) == _run(plain, prompts, adapters)
    assert bucketed.engine.runner.decode_graphs.stats.padded_rows > 0


def test_decode_graphs_default_off_on_cpu(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=16)
    assert llm.engine.runner.decode_graphs is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_eager_tokens(llama_dir):
    prompts16 = random_prompts(600, PROMPT_LENGTHS, seed=11)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=160, max_num_seqs=32)
    graphs, eager = LLM(llama_dir, decode_graphs=True, **kw), LLM(llama_dir, decode_graphs=False, **kw)
    for size in (1, 3, 8, 13, 32):
        prompts = [prompts16[i % 16] for i in range(size)]
        assert [g[0] for g in _run(graphs, prompts)] == [e[0] for e in _run(eager, prompts)], size
    assert graphs.engine.runner.decode_graphs.stats.captures >= 5
