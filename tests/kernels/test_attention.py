"""paged_attention_ref against a naive dense implementation; write_kv scatter."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention, paged_attention_ref, write_kv

MIXED = ([1, 7, 1, 12, 3, 1], [9, 7, 20, 33, 5, 1])  # decode, fresh prefill, chunk over cached context


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim", "window"),
    [(4, 2, 1, 32, None), (8, 2, 4, 64, None), (16, 1, 2, 128, None), (4, 2, 2, 32, 5), (8, 1, 8, 64, 1)],
)
def test_reference_matches_naive_on_mixed_batches(
    block_size, num_kv_heads, group, head_dim, window, paged_batch, dense_attention
) -> None:
    batch = paged_batch(*MIXED, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                       head_dim=head_dim, seed=block_size + group)
    scale = head_dim**-0.5
    out = paged_attention_ref(*batch.args(), scale, window)
    torch.testing.assert_close(out.double(), dense_attention(batch, scale, window), atol=1e-5, rtol=1e-5)


def test_reference_skips_sequences_without_query_tokens_and_keeps_dtype(paged_batch, dense_attention) -> None:
    batch = paged_batch([2, 0, 1], [6, 4, 3], block_size=4, num_kv_heads=2, group=2, head_dim=32,
                       dtype=torch.bfloat16)
    out = paged_attention_ref(*batch.args(), 0.2, None)
    assert out.dtype == torch.bfloat16 and out.shape == batch.q.shape
    torch.testing.assert_close(out.double(), dense_attention(batch, 0.2, None), atol=2e-2, rtol=2e-2)


def test_dispatch_uses_reference_on_cpu(paged_batch) -> None:
    batch = paged_batch(*MIXED, block_size=4, num_kv_heads=2, group=2, head_dim=32)
    torch.testing.assert_close(paged_attention(*batch.args(), 0.3, 4), paged_attention_ref(*batch.args(), 0.3, 4))


def test_write_kv_scatters_tokens_into_their_slots() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, 0, 11])  # block 1 offset 1, block 0 offset 0, block 2 offset 3
    write_kv(k, v, k_cache, v_cache, slots)
    for t, (block, offset) in enumerate([(1, 1), (0, 0), (2, 3)]):
        assert torch.equal(k_cache[block, offset], k[t]) and torch.equal(v_cache[block, offset], v[t])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3
