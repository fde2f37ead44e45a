"""The only owner of tensors: model weights, the paged KV cache, and the per-step inputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, ModelConfig
from engine.decode_graph import DecodeGraphs
from engine.loader import load_weights
from engine.models.llama import AttentionInputs, LlamaModel
from engine.plan import BatchPlan, ModelOutput, SampleRow
from engine.quantization import resolve as resolve_quantization
from engine.sampler import Sampler
from kernels import hugepages
from kernels.attention import StepAttentionPlan, cache_row_width

if TYPE_CHECKING:
    from engine.lora_slots import LoRASlots

# A step's constrained rows -> (bitmask, their row indices), or None when no row is constrained.
GrammarMasker = Callable[[list[SampleRow]], "tuple[torch.Tensor, list[int]] | None"]


class ModelRunner:
    """Loads the model, allocates the KV cache, and executes BatchPlans.

    Constructing one needs no GPU; `device` decides where tensors live.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, *, lora: LoRASlots | None = None,
                 grammar_masker: GrammarMasker | None = None) -> None:
        """`lora` builds each step's LoRAContext (None: base model only); `grammar_masker` gives a step's
        (bitmask, constrained row indices), e.g. StructuredOutputManager.fill (None: no constraints)."""
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype(model_config)
        self.kv_dtype = config.kv_cache_torch_dtype(model_config)
        self.max_model_len = config.resolved_max_model_len(model_config)
        self.quantization = resolve_quantization(config, model_config)  # None: full-precision weights
        weights = load_weights(Path(config.model), model_config, self.dtype, self.quantization)
        self.model = LlamaModel(model_config, weights, self.device, self.max_model_len)
        self.weight_bytes = self.model.weight_bytes  # resident parameter bytes (worker state and metrics)
        self.num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        # one block past the pool: the scratch block decode buckets' pad rows write into (no sequence owns it)
        arena = self._kv_arena()
        self.kv_caches = [(self._kv_buffer(arena), self._kv_buffer(arena)) for _ in range(model_config.num_layers)]
        self.sampler = Sampler(model_config.vocab_size, self.device, config.seed)
        self.lora = lora
        self.grammar_masker = grammar_masker
        self.decode_graphs = None
        if config.uses_decode_graphs():
            self.decode_graphs = DecodeGraphs(
                self.model, self.kv_caches, config.block_size, self.max_model_len, scratch_block=self.num_blocks,
                device=self.device, max_batch=min(config.decode_graph_max_batch, config.max_num_seqs),
                sliding_window=model_config.sliding_window)

    def _kv_arena(self) -> hugepages.Arena | None:
        """On the CPU, one huge-page region for every layer's cache (None elsewhere, or without huge pages).

        A decode step at batch 32 reads ~200 MB of cache (the bench model, bf16, ~300 positions): in 4 KB
        pages that is a TLB miss and a cold start of the hardware prefetcher every 4 KB of a head's rows."""
        if self.device.type != "cpu":
            return None
        return hugepages.make_arena((self.num_blocks + 1) * self._kv_block_bytes() + 2 * self.model_config.num_layers
                                    * hugepages.ALIGN)

    def _kv_buffer(self, arena: hugepages.Arena | None) -> torch.Tensor:
        """One layer's keys or values: logical shape (num_blocks, block_size, H_kv, W), the layout every
        attention kernel takes (W = head_dim, or head_dim + 4 for int8 rows and their scales:
        kernels.attention). On the CPU the storage is head-major, (H_kv, num_blocks, block_size, W), so the
        torch path gathers a decode batch's keys without a second copy, and lies in `arena` when there is
        one; Triton reads any strides.
        """
        mc, bs, blocks = self.model_config, self.config.block_size, self.num_blocks + 1  # + the scratch block
        width = cache_row_width(mc.head_dim, self.kv_dtype)
        if self.device.type == "cpu":
            shape = (mc.num_kv_heads, blocks, bs, width)
            storage = arena.zeros(shape, self.kv_dtype) if arena is not None else torch.zeros(shape, dtype=self.kv_dtype)
            return storage.permute(1, 2, 0, 3)
        return torch.zeros(blocks, bs, mc.num_kv_heads, width, dtype=self.kv_dtype, device=self.device)

    def _kv_block_bytes(self) -> int:
        """Bytes of one block of every layer's keys and values."""
        mc = self.model_config
        return (2 * mc.num_layers * self.config.block_size * mc.num_kv_heads
                * cache_row_width(mc.head_dim, self.kv_dtype) * torch.empty((), dtype=self.kv_dtype).element_size())

    @property
    def kv_cache_bytes(self) -> int:
        """Resident bytes of the KV cache (the pool and its scratch block)."""
        return (self.num_blocks + 1) * self._kv_block_bytes()

    def _blocks_that_fit(self) -> int:
        return max(1, int(self.config.kv_cache_memory_gb * (1 << 30)) // self._kv_block_bytes())

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> ModelOutput:
        """One forward over the plan's tokens, then sample one token per SampleRow."""
        self.sampler.forget(plan.finished_req_ids)
        if plan.is_empty:
            return ModelOutput([])
        dev = self.device
        if self.decode_graphs is not None and self.decode_graphs.accepts(plan):
            hidden = self.decode_graphs.run(plan, self.lora.context_for_tokens if self.lora is not None else None)
        else:
            input_ids = torch.tensor(plan.token_ids, dtype=torch.long, device=dev)  # (T,)
            positions = torch.tensor(plan.positions, dtype=torch.long, device=dev)  # (T,)
            attn = self._attention_inputs([s.block_table for s in plan.seqs],
                                          [s.query_start for s in plan.seqs] + [plan.num_tokens],
                                          [s.seq_len for s in plan.seqs], plan.slot_mapping)
            lora_ctx = self.lora.context(plan) if self.lora is not None else None
            hidden = self.model.forward(input_ids, positions, self.kv_caches, attn, lora_ctx)  # (T, H)
        if not plan.sample_rows:
            return ModelOutput([])
        index = torch.tensor([r.token_index for r in plan.sample_rows], device=dev)
        logits = self.model.compute_logits(hidden[index])  # (N, V) float32
        grammar = self.grammar_masker(plan.sample_rows) if self.grammar_masker is not None else None
        return ModelOutput(self.sampler(logits, plan.sample_rows, grammar))

    def _attention_inputs(self, tables: list[list[int]], starts: list[int], seq_lens: list[int],
                          slot_mapping: list[int]) -> AttentionInputs:
        dev = self.device
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32,
                                    device=dev)  # (S, max_blocks)
        query_start_loc = torch.tensor(starts, dtype=torch.int32, device=dev)  # (S + 1,)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)  # (S,)
        plan = None
        if dev.type == "cpu":  # the torch attention path: do its per-step work once, not once per layer
            plan = StepAttentionPlan.build(block_tables, query_start_loc, seq_lens_t, self.config.block_size,
                                           self.model_config.sliding_window)
        return AttentionInputs(block_tables, query_start_loc, seq_lens_t,
                               torch.tensor(slot_mapping, dtype=torch.long, device=dev), plan)  # slots: (T,)

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int], lora_slot: int = -1) -> torch.Tensor:
        """Logits of every position of one prompt, computed in scratch blocks. For tests and tools.

        Uses the last blocks of the pool; call only while the engine is idle. `lora_slot` >= 0 runs the
        adapter resident in that slot (see LoRASlots.ensure_resident).
        """
        bs = self.config.block_size
        n_blocks = -(-len(token_ids) // bs)
        table = list(range(self.num_blocks - n_blocks, self.num_blocks))
        dev = self.device
        attn = self._attention_inputs([table], [0, len(token_ids)], [len(token_ids)],
                                      [table[p // bs] * bs + p % bs for p in range(len(token_ids))])
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        lora_ctx = None
        if lora_slot >= 0 and self.lora is not None:
            lora_ctx = self.lora.context_for_tokens([lora_slot] * len(token_ids))
        hidden = self.model.forward(ids, torch.arange(len(token_ids), device=dev), self.kv_caches, attn, lora_ctx)
        return self.model.compute_logits(hidden)
