"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter when there is no GPU.

NOTE: `@triton.jit` picks interpreted or compiled kernels when a kernel module is imported, reading
TRITON_INTERPRET (triton.knobs.runtime.interpret) at that moment, so the variable is set here, at import,
before any test module imports `kernels.*_triton`. `test_*_triton.py` assert that the kernels they launch
really are interpreted functions. With a GPU the kernels compile and the same tests run on CUDA tensors.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from kernels.lora_weights import LoRAStackedWeights

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ops():
    """The native CPU ops (kernels/native_cpu.py). They must build on every machine the suite runs on (setup
    installs g++ and ninja): a silent fall back to the torch path would leave the engine's CPU serving path
    untested, so their absence fails the tests that take this fixture."""
    from kernels import native_cpu

    if not native_cpu.enabled():
        pytest.skip(f"{native_cpu.NATIVE_ENV}=0")
    loaded = native_cpu.ops()
    assert loaded is not None, f"the native CPU ops did not build: {native_cpu.error()}"
    return loaded


@pytest.fixture
def triton_device() -> torch.device:
    """Where Triton kernels run in this session: the CPU under the interpreter, else the GPU."""
    from triton import knobs

    if knobs.runtime.interpret:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("Triton is compiled (TRITON_INTERPRET unset) but there is no CUDA device")
    return torch.device("cuda")


@dataclass(frozen=True)
class PagedBatch:
    q: torch.Tensor  # (T, H_q, D)
    k_cache: torch.Tensor  # (num_blocks, block_size, H_kv, D)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, random distinct block ids, 0-padded
    query_start_loc: torch.Tensor  # (num_seqs + 1,) int32
    seq_lens: torch.Tensor  # (num_seqs,) int32

    def args(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
        return tuple(t.to(device) for t in (self.q, self.k_cache, self.v_cache, self.block_tables,
                                            self.query_start_loc, self.seq_lens))


def make_batch(
    query_lens: list[int], seq_lens: list[int], *, block_size: int, num_kv_heads: int, group: int,
    head_dim: int, dtype: torch.dtype = torch.float32, seed: int = 0,
) -> PagedBatch:
    """Sequences with `seq_lens` tokens in KV, the last `query_lens` of them queried this step."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage nobody may read
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = ids[used : used + n]
        used += n
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        q=torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        block_tables=tables,
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


def naive_attention(batch: PagedBatch, scale: float, sliding_window: int | None,
                    decode_probs: torch.dtype | None = None) -> torch.Tensor:
    """Dense float64 attention, one sequence and one query token at a time, keys read position by position;
    a decode row's (one query token's) probabilities rounded to `decode_probs` first when given."""
    q, k_cache, v_cache = batch.q.double(), batch.k_cache.double(), batch.v_cache.double()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    starts = batch.query_start_loc.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        table = batch.block_tables[s].tolist()
        keys = torch.stack([k_cache[table[j // block_size], j % block_size] for j in range(seq_len)])
        values = torch.stack([v_cache[table[j // block_size], j % block_size] for j in range(seq_len)])
        query_len = starts[s + 1] - starts[s]
        for i in range(query_len):
            pos = seq_len - query_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(q.shape[1]):
                k = keys[lo : pos + 1, h // group]  # (n_keys, D)
                weights = torch.softmax(scale * (k @ q[starts[s] + i, h]), dim=0)
                if decode_probs is not None and query_len == 1:
                    weights = weights.to(decode_probs).double()
                out[starts[s] + i, h] = weights @ values[lo : pos + 1, h // group]
    return out


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """Factory: paged_batch(query_lens, seq_lens, block_size=, num_kv_heads=, group=, head_dim=, ...)."""
    return make_batch


@pytest.fixture
def dense_attention() -> Callable[..., torch.Tensor]:
    """The naive dense float64 attention the reference and the kernels are checked against."""
    return naive_attention


def popular_slots(mix: str, num_requests: int, num_slots: int, gen: torch.Generator) -> list[int]:
    """One slot per request under an adapter popularity mix (-1 = base model)."""
    if mix == "distinct":
        return list(range(num_requests))
    if mix == "identical":
        return [num_slots - 1] * num_requests
    if mix == "uniform":
        return torch.randint(0, num_slots, (num_requests,), generator=gen).tolist()
    if mix == "skewed":  # most requests on slot 0, a long tail on the others
        tail = torch.randint(1, num_slots, (num_requests,), generator=gen)
        return torch.where(torch.rand(num_requests, generator=gen) < 0.7, 0, tail).tolist()
    if mix == "with_base":
        return torch.randint(-1, num_slots, (num_requests,), generator=gen).tolist()
    raise ValueError(f"unknown mix {mix!r}")


def make_token_slots(mix: str, layout: str, num_slots: int, seed: int = 0) -> list[int]:
    """Per-token slots: "decode" = one token per request, "prefill" = a run of 1..9 tokens per request."""
    gen = torch.Generator().manual_seed(seed)
    num_requests = num_slots if mix == "distinct" else 10
    per_request = popular_slots(mix, num_requests, num_slots, gen)
    if layout == "decode":
        return per_request
    lengths = torch.randint(1, 10, (num_requests,), generator=gen).tolist()
    return [slot for slot, n in zip(per_request, lengths, strict=True) for _ in range(n)]


def make_lora_weights(
    ranks: list[list[int]], in_features: int, slice_sizes: tuple[int, ...], max_rank: int,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> LoRAStackedWeights:
    """Slots with the given per-slice ranks (0 = slice not adapted); padding filled with garbage so a
    kernel that reads past a slot's rank gets a wrong answer."""
    gen = torch.Generator().manual_seed(seed)
    weights = LoRAStackedWeights.allocate(len(ranks), max_rank, in_features, slice_sizes, dtype)
    for slot, slot_ranks in enumerate(ranks):
        a = [torch.randn(r, in_features, generator=gen) if r else None for r in slot_ranks]
        b = [torch.randn(n, r, generator=gen) if r else None for n, r in zip(slice_sizes, slot_ranks, strict=True)]
        scaling = [0.5 + slot + i for i in range(len(slice_sizes))]
        weights.write_slot(slot, a, b, scaling)
        for i, (r, offset, n) in enumerate(zip(slot_ranks, weights.slice_offsets, slice_sizes, strict=True)):
            weights.lora_a[slot, i * max_rank + r : (i + 1) * max_rank] = 1e3
            weights.lora_b[slot, offset : offset + n, r:] = -1e3
    return weights


@pytest.fixture
def lora_batch() -> Callable[..., list[int]]:
    """Factory: lora_batch(mix, layout, num_slots, seed=0) -> per-token slot ids."""
    return make_token_slots


@pytest.fixture
def lora_weights() -> Callable[..., LoRAStackedWeights]:
    """Factory: lora_weights(ranks, in_features, slice_sizes, max_rank, dtype, seed) -> stacked slots."""
    return make_lora_weights
