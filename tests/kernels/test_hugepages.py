"""The huge-page arena the CPU model's weights move into (kernels.hugepages)."""

from __future__ import annotations

import pytest
import torch

from kernels import hugepages


def test_the_arena_holds_exact_copies_on_cache_lines():
    if not hugepages.enabled():
        pytest.skip("no MADV_HUGEPAGE here (or LORAPLEX_CPU_HUGEPAGES=0)")
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).bfloat16(),
               torch.randint(-127, 127, (4, 9), generator=g, dtype=torch.int8), torch.randn(33, 2, generator=g)]
    arena = hugepages.make_arena(sum(hugepages.Arena.footprint(t) for t in tensors))
    assert arena is not None
    copies = [arena.put(t) for t in tensors]
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() % hugepages.ALIGN == 0 and c.data_ptr() != t.data_ptr()
    with pytest.raises(ValueError, match="full"):
        arena.put(torch.zeros(hugepages.HUGE_PAGE))
    with pytest.raises(ValueError, match="full"):
        arena.zeros((hugepages.HUGE_PAGE,), torch.uint8)
    del arena
    assert torch.equal(copies[0], tensors[0])  # a copy keeps the region alive


def test_switched_off_nothing_is_allocated(monkeypatch):
    monkeypatch.setenv(hugepages.HUGEPAGES_ENV, "0")
    assert hugepages.make_arena(1 << 20) is None


def test_the_model_streams_its_projections_from_the_arena(llama_dir, monkeypatch):
    """Same greedy tokens with the weights moved and left in place; moved ones live in one region."""
    from engine import LLM, SamplingParams

    if not hugepages.enabled():
        pytest.skip("no MADV_HUGEPAGE here")
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7]}, {"prompt_token_ids": list(range(40, 80))}]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    moved = LLM(llama_dir, num_kv_blocks=32)
    want = [o.outputs[0].token_ids for o in moved.generate(prompts, params)]
    model = moved.engine.runner.model
    panels = [w.packed for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
              if getattr(w, "layout", None) == "panels"]
    if panels:  # native panels (AVX-512 machines): every one is a view of the one arena
        assert len({p.untyped_storage().data_ptr() for p in panels}) == 1
    monkeypatch.setenv(hugepages.HUGEPAGES_ENV, "0")
    kept = LLM(llama_dir, num_kv_blocks=32)
    kept_panels = [layer.qkv.packed for layer in kept.engine.runner.model.layers
                   if getattr(layer.qkv, "layout", None) == "panels"]
    assert len({p.untyped_storage().data_ptr() for p in kept_panels}) == len(kept_panels)  # left in place
    assert [o.outputs[0].token_ids for o in kept.generate(prompts, params)] == want


def test_the_kv_cache_lies_in_one_region_of_zeros_that_do_not_overlap(llama_dir, monkeypatch):
    """Every layer's keys and values are views of one huge-page region (the decode step streams them), start
    as zeros, and do not overlap; switched off, each is its own tensor. Outputs are the same either way."""
    from engine import LLM, SamplingParams

    if not hugepages.enabled():
        pytest.skip("no MADV_HUGEPAGE here")
    prompts = [{"prompt_token_ids": list(range(3, 60))}]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    llm = LLM(llama_dir, num_kv_blocks=16)
    caches = [c for kc in llm.engine.runner.kv_caches for c in kc]
    assert len({c.untyped_storage().data_ptr() for c in caches}) == 1
    assert all(not c.any() for c in caches)
    spans = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in caches)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setenv(hugepages.HUGEPAGES_ENV, "0")
    kept = LLM(llama_dir, num_kv_blocks=16)
    kept_caches = [c for kc in kept.engine.runner.kv_caches for c in kc]
    assert len({c.untyped_storage().data_ptr() for c in kept_caches}) == len(kept_caches)
    assert [o.outputs[0].token_ids for o in kept.generate(prompts, params)] == want
