"""Decode steps at fixed batch sizes: persistent inputs per bucket, replayed as CUDA graphs on a GPU.

A decode step (every sequence has one query token) is the same program every time; only the values of
its inputs change. `DecodeGraphs` rounds such a step's batch up to a bucket size (1, 2, 4, 8, then
multiples of 8 up to `max_batch`), copies the step's inputs into that bucket's persistent tensors, and
runs the model over them:

- on CUDA it captures one CUDA graph per bucket on first use and replays it, so a step costs one launch
  instead of one per kernel (the launch overhead that dominates small-batch decode on a GPU);
- on the CPU the same buffers run eagerly (there is no launch to save, and Inductor's compiled decode
  measured slower than eager torch here: see docs/benchmarks.md), so `EngineConfig.decode_graphs`
  leaves it off there by default; turning it on runs exactly what a GPU would, for tests and A/B runs.

Padding rows take token 0 at position 0, write their key/value into a scratch KV block that no sequence
owns (the runner allocates one block past the pool), attend only to it, and sample nothing: a real row's
result does not depend on how many pad rows share its bucket, which is what the equivalence test checks
(same greedy tokens as the plain path at every batch size 1..32).

Inputs that change shape per step stay out of the captured program: the block table is `max_blocks`
wide (the longest sequence the engine allows), the attention kernel reads each row's length from
`seq_lens`, and every decode row is passed as such (`AttentionInputs.decode_seqs`), so nothing is read
back to the host inside the graph. Steps with LoRA tokens run the buffers eagerly on every device (their
per-step segment metadata is built on the host); sampling and grammar masks stay outside as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.models.llama import AttentionInputs, LlamaModel, LoRAContext
from engine.plan import BatchPlan
from kernels.attention import StepAttentionPlan

DEFAULT_MAX_BATCH = 32


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, 32, ... up to max_batch (the sizes vLLM captures CUDA graphs at, in short)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


@dataclass
class _Bucket:
    size: int
    input_ids: torch.Tensor  # (b,) int64
    positions: torch.Tensor  # (b,) int64
    slot_mapping: torch.Tensor  # (b,) int64
    block_tables: torch.Tensor  # (b, max_blocks) int32
    seq_lens: torch.Tensor  # (b,) int32
    query_start_loc: torch.Tensor  # (b + 1,) int32: 0, 1, ..., b
    decode_seqs: torch.Tensor  # (b,) int32: 0 .. b - 1
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # the captured graph's output, (b, H)


@dataclass
class DecodeGraphStats:
    steps: int = 0  # decode steps run through a bucket
    padded_rows: int = 0  # pad rows those steps computed
    captures: int = 0  # CUDA graphs captured


class DecodeGraphs:
    """Bucketed decode over persistent inputs (see the module docstring). Owned by the ModelRunner."""

    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_model_len: int, scratch_block: int, device: torch.device, max_batch: int = DEFAULT_MAX_BATCH,
                 sliding_window: int | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch_block = scratch_block
        self.device = device
        self.sliding_window = sliding_window
        self.sizes = bucket_sizes(max_batch)
        self.capture = device.type == "cuda"
        self.stats = DecodeGraphStats()
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None  # the CUDA graphs' shared memory pool (torch.cuda.graph_pool_handle)

    def accepts(self, plan: BatchPlan) -> bool:
        """A step this runs: decode only, within the largest bucket, blocks within the table's width."""
        return (0 < len(plan.seqs) <= self.sizes[-1] and all(s.query_len == 1 for s in plan.seqs)
                and all(len(s.block_table) <= self.max_blocks for s in plan.seqs))

    def run(self, plan: BatchPlan, lora: Callable[[list[int]], LoRAContext | None] | None = None) -> torch.Tensor:
        """Hidden states of the plan's tokens, (B, H), from the bucket that fits B. `lora` builds the step's
        LoRA context from per-row slots (pad rows -1); with any adapted row the bucket runs eagerly."""
        n = len(plan.seqs)
        bucket = self._bucket(next(size for size in self.sizes if size >= n))
        self._fill(bucket, plan)
        self.stats.steps += 1
        self.stats.padded_rows += bucket.size - n
        slots = [s.lora_slot for s in plan.seqs] + [-1] * (bucket.size - n)
        lora_ctx = lora(slots) if lora is not None and any(s >= 0 for s in slots) else None
        if self.capture and lora_ctx is None:
            if bucket.graph is None:
                self._capture(bucket)
            assert bucket.graph is not None and bucket.hidden is not None
            bucket.graph.replay()
            return bucket.hidden[:n]
        return self._forward(bucket, lora_ctx)[:n]

    def _forward(self, bucket: _Bucket, lora_ctx: LoRAContext | None) -> torch.Tensor:
        attn_plan = None
        if self.device.type == "cpu":  # the torch path's per-step precomputation (host work, no graph)
            attn_plan = StepAttentionPlan.build(bucket.block_tables, bucket.query_start_loc, bucket.seq_lens,
                                                self.block_size, self.sliding_window)
        attn = AttentionInputs(bucket.block_tables, bucket.query_start_loc, bucket.seq_lens, bucket.slot_mapping,
                               attn_plan, decode_seqs=bucket.decode_seqs)
        return self.model.forward(bucket.input_ids, bucket.positions, self.kv_caches, attn, lora_ctx)

    def _bucket(self, size: int) -> _Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            dev, i32, i64 = self.device, torch.int32, torch.long
            bucket = _Bucket(
                size=size,
                input_ids=torch.zeros(size, dtype=i64, device=dev),
                positions=torch.zeros(size, dtype=i64, device=dev),
                slot_mapping=torch.zeros(size, dtype=i64, device=dev),
                block_tables=torch.zeros(size, self.max_blocks, dtype=i32, device=dev),
                seq_lens=torch.ones(size, dtype=i32, device=dev),
                query_start_loc=torch.arange(size + 1, dtype=i32, device=dev),
                decode_seqs=torch.arange(size, dtype=i32, device=dev),
            )
            self._buckets[size] = bucket
        return bucket

    def _fill(self, bucket: _Bucket, plan: BatchPlan) -> None:
        """Copy the step's inputs into the bucket's tensors; rows past the plan become pad rows."""
        pad = bucket.size - len(plan.seqs)
        scratch_slot = self.scratch_block * self.block_size
        # Only the columns this step's longest table needs: columns past a row's length are never read (its
        # seq_len masks them), so what an earlier step left there is harmless.
        width = max(len(s.block_table) for s in plan.seqs)
        table = torch.full((bucket.size, width), self.scratch_block, dtype=torch.int32)
        for row, seq in enumerate(plan.seqs):
            table[row, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        host = {
            "input_ids": torch.tensor(plan.token_ids + [0] * pad, dtype=torch.long),
            "positions": torch.tensor(plan.positions + [0] * pad, dtype=torch.long),
            "slot_mapping": torch.tensor(plan.slot_mapping + [scratch_slot] * pad, dtype=torch.long),
            "seq_lens": torch.tensor([s.seq_len for s in plan.seqs] + [1] * pad, dtype=torch.int32),
        }
        for name, values in host.items():
            getattr(bucket, name).copy_(values, non_blocking=True)
        bucket.block_tables[:, :width].copy_(table, non_blocking=True)

    def _capture(self, bucket: _Bucket) -> None:
        """Record the bucket's forward into a CUDA graph (after one warm-up run on a side stream)."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(bucket, None)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.hidden = self._forward(bucket, None)
        bucket.graph = graph
        self.stats.captures += 1
