"""Llama-family decoder over a flat batch of tokens and paged KV.

One forward serves a mixed batch of prefill chunks and decode tokens from many sequences: tokens are
concatenated into (T, hidden) and attention finds each sequence's keys through its block table.
Covers LlamaForCausalLM (incl. Llama 3.1 rope scaling), MistralForCausalLM (sliding window),
Qwen2ForCausalLM (q/k/v bias) and Qwen3ForCausalLM (per-head q/k RMSNorm); GQA; tied embeddings.
Every projection (and an untied lm_head) is a dense tensor or a weight-only quantized one
(engine.quantization); `kernels.quant.linear` runs either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.models.rope import RotaryEmbedding
from kernels import dense_cpu, hugepages, native_cpu
from kernels.attention import NATIVE_CACHE_DTYPES, StepAttentionPlan, paged_attention, write_kv
from kernels.fused import add_rms_norm, rms_norm_ref, rope_store_kv, silu_mul
from kernels.lora_meta import LoRABatchMeta
from kernels.quant import Int4Weight, Int8Weight, Weight, concat, dequantize, linear, nbytes, place
from kernels.quant import rows as quant_rows


class LoRAContext(Protocol):
    """Adds this step's LoRA deltas. Groups: "qkv", "o", "gate_up", "down" (fused projections)."""

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += scaling * (x @ A.T) @ B.T for each token's adapter, per slice of the group. In place."""
        ...

    meta: LoRABatchMeta  # the step's tokens' slots

    def native_layer_args(self, layer: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]] | None:
        """The same adds as operands of the native decode layer, or None (see engine.lora_buffers)."""
        ...


@dataclass(frozen=True)
class AttentionInputs:
    block_tables: torch.Tensor  # (S, max_blocks) int32
    query_start_loc: torch.Tensor  # (S + 1,) int32
    seq_lens: torch.Tensor  # (S,) int32
    slot_mapping: torch.Tensor  # (T,) int64
    plan: StepAttentionPlan | None = None  # the torch path's per-step precomputation (CPU)
    # (S,) int32 indices of every sequence when all of them decode (engine.decode_graph): the kernels then
    # need nothing from the host, so the step can be captured as a CUDA graph. None: found per step.
    decode_seqs: torch.Tensor | None = None


rms_norm = rms_norm_ref  # HF's LlamaRMSNorm: the per-head q/k norms of Qwen3


@dataclass
class _Layer:
    input_norm: torch.Tensor  # (H,)
    post_norm: torch.Tensor  # (H,)
    qkv: Weight  # (q + 2 kv, H) fused q/k/v projection
    qkv_bias: torch.Tensor | None  # (q + 2 kv,)
    o: Weight  # (H, q)
    q_norm: torch.Tensor | None  # (D,)
    k_norm: torch.Tensor | None  # (D,)
    gate_up: Weight  # (2 I, H) fused gate/up projection
    down: Weight  # (H, I)

    # the native layer_forward op's weight arguments (kernels/csrc/cpu_ops.cpp), when every projection is in
    # native panels; None: the layer always runs op by op
    native_args: tuple[Any, ...] | None = None
    # gate_up's native operands (weight, scales) for the fused silu_linear op; None: linear, then silu_mul
    gate_up_native: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def weights(self) -> list[Weight]:
        return [w for w in (self.input_norm, self.post_norm, self.qkv, self.qkv_bias, self.o, self.q_norm,
                            self.k_norm, self.gate_up, self.down) if w is not None]


def _dense(w: Weight, device: torch.device | str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a dense tensor, got {type(w).__name__}")
    return w.to(device)


def _fuse(parts: list[Weight]) -> Weight:
    """Stack projections along their outputs (dense or quantized alike; quantization is per output row)."""
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(dense) == len(parts):
        return torch.cat(dense)
    quantized = [p for p in parts if isinstance(p, Int8Weight | Int4Weight)]
    if len(quantized) != len(parts):
        raise ValueError("a fused projection mixes quantized and dense weights")
    return concat(quantized)


def _native_operands(w: Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, scales) as the native panel ops take them (kernels/csrc/cpu_ops.cpp's panel_linear): dense in
    the activation dtype, or int8 / int4 panels (int8 quads for w8a8, int4 quads for w4a8); None for any other
    weight."""
    if isinstance(w, dense_cpu.PackedDense) and w.layout == "panels" and w.dtype == dtype:
        return w.packed, None
    if isinstance(w, Int8Weight) and w.layout in ("panels", "quads") and w.scales.dtype == dtype:
        return w.qweight, w.scales
    if isinstance(w, Int4Weight) and w.scale_zeros.dtype == dtype and (
            w.layout == "quads" or (w.layout == "panels" and w.activations == "float")):  # panels read x as it is
        return w.qweight, w.scale_zeros
    return None


def _native_args(layer: _Layer, dtype: torch.dtype) -> tuple[Any, ...] | None:
    """layer_forward's weight arguments for `layer`, or None unless all four projections are native panels
    (dense in the activation dtype, or int8 / int4 panels) and its norms share that dtype."""
    args: list[Any] = []
    widths: list[int] = []
    for name, w in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down)):
        operands = _native_operands(w, dtype)
        if operands is None:
            return None
        args += list(operands)
        widths.append(w.shape[0])
        if name == "qkv":
            args.append(None if layer.qkv_bias is None else layer.qkv_bias.float().contiguous())
    if layer.post_norm.dtype != dtype:
        return None
    return (*args, widths, layer.post_norm.contiguous())


class LlamaModel:
    """Weights plus the forward pass. Holds no per-request state; the runner owns the KV tensors."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight], device: torch.device | str,
                 max_positions: int) -> None:
        """`weights`: HF-named tensors (engine.loader), projections dense or quantized; fused on the host,
        then placed on `device` in the layout its kernels read."""
        self.cfg = cfg
        w = weights
        table = w["model.embed_tokens.weight"]  # (V, H)
        self.embed: torch.Tensor | dense_cpu.PackedDense | Int8Weight
        if isinstance(table, Int8Weight):  # a tied table held as int8 (--quantize-lm-head): one copy for both
            placed = place(table, device)
            assert isinstance(placed, Int8Weight)
            self.embed = placed
        else:
            self.embed = _dense(table, device)
        self.lm_head: Weight = self.embed if cfg.tie_word_embeddings else place(w["lm_head.weight"], device)
        if cfg.tie_word_embeddings and isinstance(self.embed, torch.Tensor) and dense_cpu.has_row_access(self.embed):
            # one copy serves both: bf16 panels for the lm_head's matmul, and rows for the embedding lookup
            self.embed = self.lm_head = dense_cpu.pack(self.embed)
        self.norm = _dense(w["model.norm.weight"], device)
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if cfg.qkv_bias:
                bias = _dense(_fuse([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]), device)
            self.layers.append(_Layer(
                input_norm=_dense(w[p + "input_layernorm.weight"], device),
                post_norm=_dense(w[p + "post_attention_layernorm.weight"], device),
                qkv=place(_fuse([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]), device),
                qkv_bias=bias,
                o=place(w[a + "o_proj.weight"], device),
                q_norm=_dense(w[a + "q_norm.weight"], device) if cfg.qk_norm else None,
                k_norm=_dense(w[a + "k_norm.weight"], device) if cfg.qk_norm else None,
                gate_up=place(_fuse([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]), device),
                down=place(w[p + "mlp.down_proj.weight"], device),
            ))
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, device)
        self.scale = cfg.head_dim**-0.5
        if torch.device(device).type == "cpu":
            self._weights_to_huge_pages()
        self._native_layer: Any = None  # torch.ops.loraplex_cpu.layer_forward where every layer has native_args
        self._native_prefill = False  # whether it also runs steps with prefill chunks (native prefill attention)
        self._no_rows = torch.empty(0, dtype=torch.int64)  # a step's decode rows and ids when it has none
        self._silu_linear: Any = None  # torch.ops.loraplex_cpu.silu_linear where a layer has gate_up_native
        # torch.ops.loraplex_cpu.layers_forward (every layer in one call) beside _native_layer, with its
        # weight lists (built once)
        self._native_layers: Any = None
        self._stack_args: tuple[Any, ...] = ()
        if torch.device(device).type == "cpu" and (ops := native_cpu.ops()) is not None:
            for layer in self.layers:
                layer.gate_up_native = _native_operands(layer.gate_up, self.dtype)
            self._silu_linear = ops.silu_linear.default
        if not cfg.qk_norm:
            for layer in self.layers:
                layer.native_args = _native_args(layer, self.dtype)
            ops = native_cpu.ops() if all(layer.native_args is not None for layer in self.layers) else None
            if ops is not None:
                self._native_layer = ops.layer_forward.default
                self._native_prefill = ops.has_prefill_attention() and cfg.head_dim in (64, 128)
                self._native_layers = ops.layers_forward.default
                self._stack_args = self._layer_stack_args()

    def _layer_stack_args(self) -> tuple[Any, ...]:
        """layers_forward's weight lists: every layer's native_args, flattened as the op slices them."""
        weights: list[torch.Tensor] = []
        extras: list[torch.Tensor | None] = []
        widths: list[int] = []
        norms: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            assert layer.native_args is not None
            qkv_w, qkv_s, qkv_b, o_w, o_s, gu_w, gu_s, down_w, down_s, ns, post_norm = layer.native_args
            weights += [qkv_w, o_w, gu_w, down_w]
            extras += [qkv_s, qkv_b, o_s, gu_s, down_s]
            widths += ns
            norms += [post_norm, self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm]
        return weights, extras, widths, norms

    def _weights_to_huge_pages(self) -> None:
        """Move what a decode step streams (the projections and the lm_head, in native panels: tensors made
        here, owned by the model alone) into one huge-page arena (kernels.hugepages); other weights stay."""

        def moved(w: Weight, put: Callable[[torch.Tensor], torch.Tensor]) -> Weight:
            if isinstance(w, dense_cpu.PackedDense) and w.layout == "panels":
                return dataclasses.replace(w, packed=put(w.packed))
            if isinstance(w, Int8Weight) and w.layout in ("panels", "quads"):
                return dataclasses.replace(w, qweight=put(w.qweight), scales=put(w.scales))
            if isinstance(w, Int4Weight) and w.layout in ("panels", "quads"):
                return dataclasses.replace(w, qweight=put(w.qweight), scale_zeros=put(w.scale_zeros))
            return w  # plain tensors may be the loader's own (or a file's mapping): not copied

        names = ("qkv", "o", "gate_up", "down")
        sizes: list[int] = []

        def measure(t: torch.Tensor) -> torch.Tensor:
            sizes.append(hugepages.Arena.footprint(t))
            return t

        for w in [self.lm_head, *(getattr(layer, name) for layer in self.layers for name in names)]:
            moved(w, measure)
        arena = hugepages.make_arena(sum(sizes))
        if arena is None:
            return
        for layer in self.layers:
            for name in names:
                setattr(layer, name, moved(getattr(layer, name), arena.put))
        tied = self.embed is self.lm_head
        self.lm_head = moved(self.lm_head, arena.put)
        if tied:
            self.embed = self.lm_head  # type: ignore[assignment]

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of every parameter (quantized weights with their scales; a tied lm_head once)."""
        params: list[Weight] = [self.embed, self.norm]
        if not self.cfg.tie_word_embeddings:
            params.append(self.lm_head)
        for layer in self.layers:
            params += layer.weights()
        return sum(nbytes(p) for p in params)

    def dequantized_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 weights, on the CPU, of exactly what this model computes with (quantized weights
        dequantized, fused projections split): load them into another model to run the same matrices."""
        cfg = self.cfg

        def full(w: Weight) -> torch.Tensor:
            return (w.float() if isinstance(w, torch.Tensor) else dequantize(w)).cpu()

        sd = {"model.embed_tokens.weight": full(self.embed), "model.norm.weight": full(self.norm)}
        if not cfg.tie_word_embeddings:
            sd["lm_head.weight"] = full(self.lm_head)
        for i, layer in enumerate(self.layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            sd[p + "input_layernorm.weight"] = full(layer.input_norm)
            sd[p + "post_attention_layernorm.weight"] = full(layer.post_norm)
            qkv_names = [a + n for n in ("q_proj", "k_proj", "v_proj")]
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
            for name, part in zip(qkv_names, full(layer.qkv).split(sizes), strict=True):
                sd[name + ".weight"] = part.contiguous()
            if layer.qkv_bias is not None:
                for name, part in zip(qkv_names, full(layer.qkv_bias).split(sizes), strict=True):
                    sd[name + ".bias"] = part.contiguous()
            sd[a + "o_proj.weight"] = full(layer.o)
            if layer.q_norm is not None and layer.k_norm is not None:
                sd[a + "q_norm.weight"], sd[a + "k_norm.weight"] = full(layer.q_norm), full(layer.k_norm)
            gate, up = full(layer.gate_up).chunk(2)
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate.contiguous(), up.contiguous()
            sd[p + "mlp.down_proj.weight"] = full(layer.down)
        return sd

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionInputs,
        lora: LoRAContext | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, (T, H). Writes this step's K/V into kv_caches."""
        cfg = self.cfg
        n_tok = input_ids.shape[0]
        cos, sin = self.rotary.tables(positions)  # (T, 1, D) each, shared by every layer
        eps, layers = cfg.rms_norm_eps, self.layers
        # x: the residual stream (T, H), owned here (add_rms_norm may update it in place); h: a norm of it
        x, h = add_rms_norm(self._embed(input_ids), None, layers[0].input_norm, eps)
        native = self._native_step_inputs(n_tok, attn, kv_caches)
        if native is not None:  # the ops below in C++: one call for every layer, or one per layer
            cos2, sin2 = cos.reshape(n_tok, cfg.head_dim), sin.reshape(n_tok, cfg.head_dim)
            slots = None if lora is None else lora.meta.token_slots
            no_lora: tuple[list[torch.Tensor], list[int]] = ([], [])
            step = (*native, cfg.num_heads, self.scale, cfg.sliding_window or 0)
            per_layer = None if lora is None else [lora.native_layer_args(i, self.dtype) for i in range(len(layers))]
            if self._native_layers is not None and (per_layer is None or all(a is not None for a in per_layer)):
                lora_tensors: list[torch.Tensor] = []
                lora_groups: list[int] = []
                for adds in per_layer or ():
                    assert adds is not None
                    lora_tensors += adds[0]
                    lora_groups += adds[1]
                k_caches, v_caches = [k for k, _ in kv_caches], [v for _, v in kv_caches]
                return self._native_layers(x, h, *self._stack_args, eps, cos2, sin2, k_caches, v_caches,
                                           attn.slot_mapping, *step, lora_tensors, lora_groups, slots)
            for i, layer in enumerate(layers):
                next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
                assert layer.native_args is not None
                adds = no_lora if per_layer is None else per_layer[i]
                if adds is None:  # an adapter group the native kernel does not run: this layer op by op
                    x, h = self._layer(i, layer, x, h, n_tok, cos, sin, kv_caches, attn, lora, next_norm)
                    continue
                h = self._native_layer(x, h, *layer.native_args, next_norm, eps, cos2, sin2, *kv_caches[i],
                                       attn.slot_mapping, *step, *adds, slots)
            return h
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.norm
            x, h = self._layer(i, layer, x, h, n_tok, cos, sin, kv_caches, attn, lora, next_norm)
        return h

    def _layer(self, i: int, layer: _Layer, x: torch.Tensor, h: torch.Tensor, n_tok: int, cos: torch.Tensor,
               sin: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn: AttentionInputs,
               lora: LoRAContext | None, next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i op by op: (the residual stream after it, its next_norm)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        qkv = linear(h, layer.qkv, layer.qkv_bias)  # (T, q + 2 kv)
        if lora is not None:
            lora.add(i, "qkv", h, qkv)
        v = qkv[:, cfg.q_size + cfg.kv_size :].reshape(n_tok, cfg.num_kv_heads, cfg.head_dim)  # (T, Hkv, D)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = qkv[:, : cfg.q_size], qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size]
            q = rms_norm(q.reshape(n_tok, cfg.num_heads, cfg.head_dim), layer.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k.reshape(n_tok, cfg.num_kv_heads, cfg.head_dim), layer.k_norm, cfg.rms_norm_eps)
            q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
            write_kv(k, v, *kv_caches[i], attn.slot_mapping)
        else:  # rotate q and k in one go (adjacent in the fused projection), and store k and v
            qk = qkv[:, : cfg.q_size + cfg.kv_size].view(n_tok, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            q = rope_store_kv(qk, v, cos, sin, cfg.num_heads, *kv_caches[i], attn.slot_mapping)
        k_cache, v_cache = kv_caches[i]
        o_in = paged_attention(
            q, k_cache, v_cache, attn.block_tables, attn.query_start_loc, attn.seq_lens, self.scale,
            cfg.sliding_window, attn.plan, attn.decode_seqs,
        ).reshape(n_tok, cfg.q_size)  # (T, q)
        o = linear(o_in, layer.o)  # (T, H)
        if lora is not None:
            lora.add(i, "o", o_in, o)
        x, h = add_rms_norm(x, o, layer.post_norm, eps)
        if lora is None and layer.gate_up_native is not None:  # one native call (fused on AMX tiles)
            act = self._silu_linear(h, *layer.gate_up_native, layer.gate_up.shape[0])
        else:
            gate_up = linear(h, layer.gate_up)  # (T, 2I)
            if lora is not None:
                lora.add(i, "gate_up", h, gate_up)
            act = silu_mul(gate_up)  # (T, I)
        down = linear(act, layer.down)  # (T, H)
        if lora is not None:
            lora.add(i, "down", act, down)
        return add_rms_norm(x, down, next_norm, eps)

    def _native_step_inputs(self, n_tok: int, attn: AttentionInputs,
                            kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[Any, ...] | None:
        """layer_forward's step arguments (block tables int32, the decode rows' sequence ids, sequence lengths
        int32, the decode rows or None for all, the prefill chunks as (first row, end row, sequence) triples),
        or None where this step runs op by op: the native ops must take the caches' dtype, and steps with
        prefill chunks need the native prefill attention. Adapters go native per layer wherever
        LoRAContext.native_layer_args gives their operands (the layer runs op by op where it does not)."""
        plan = attn.plan
        if (self._native_layer is None or plan is None
                or kv_caches[0][0].dtype not in NATIVE_CACHE_DTYPES.get(self.dtype, ())):
            return None
        lens, tables = attn.seq_lens, attn.block_tables
        tables = tables if tables.dtype == torch.int32 else tables.to(torch.int32)
        lens = (lens if lens.dtype == torch.int32 else lens.to(torch.int32)).contiguous()
        if plan.decode_seqs and len(plan.decode_seqs) == len(plan.seq_lens) == n_tok:
            return tables, plan.decode_ids, lens, None, []
        if not self._native_prefill:
            return None
        starts = plan.starts
        prefill = [v for i in range(len(plan.seq_lens)) if starts[i + 1] - starts[i] > 1
                   for v in (starts[i], starts[i + 1], i)]
        ids = plan.decode_ids if plan.decode_ids is not None else self._no_rows
        return tables, ids, lens, plan.decode_rows if plan.decode_seqs else self._no_rows, prefill

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, dense_cpu.PackedDense):
            return dense_cpu.rows(self.embed, input_ids)
        if isinstance(self.embed, Int8Weight):
            return quant_rows(self.embed, input_ids)
        return F.embedding(input_ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, V) float32 logits."""
        return linear(hidden, self.lm_head).float()
