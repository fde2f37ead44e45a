"""Triton kernels on a CUDA device: paged attention and batched LoRA at realistic sizes (needs a GPU).

Attention: Llama-3-8B-like heads (32 query, 8 kv, head_dim 128), Qwen2.5-7B-like (28 / 4) and SmolLM-like
(9 / 3, head_dim 64), 16-token blocks, decode batches over 512- and 4096-token contexts and prefill chunks,
bf16; Triton against the torch reference twin, with the KV bytes read per second. LoRA: hidden 4096, fused
q|k|v (4096, 1024, 1024), 32 slots with ranks 8/16/64 mixed, decode batches of 1/16/64/256 tokens and a
2048-token prefill over the distinct/uniform/skewed/identical mixes, bf16; the per-token (tokens) and
per-segment (segments) kernels, the dispatch's choice (auto) and the torch twin, so that the tokens vs
segments threshold of kernels.lora._use_segments can be set from measurements. Each result is checked
against the twin before it is timed (triton.testing.do_bench, median ms).

    python -m bench.gpu_kernels [--quick]      (from the repository root; bench/gpu.sh runs it)
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from functools import partial

import torch

from bench.common import print_table, write_json
from kernels import lora_triton
from kernels.attention import paged_attention, paged_attention_ref
from kernels.lora import add_lora, add_lora_ref
from kernels.lora_meta import LoRABatchMeta
from kernels.lora_weights import LoRAStackedWeights

MIXES = ("distinct", "uniform", "skewed", "identical")
NUM_SLOTS, RANKS, MAX_RANK = 32, (8, 16, 64), 64


def do_bench(fn: Callable[[], object], quick: bool) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100))


def attention_rows(quick: bool) -> list[dict]:
    shapes = [("llama3-8b", 8, 4, 128), ("qwen2.5-7b", 4, 7, 128), ("smollm", 3, 3, 64)]
    layouts = [("decode", [1] * 64, [512] * 64), ("decode", [1] * 64, [4096] * 64),
               ("decode", [1] * 256, [1024] * 256), ("prefill", [2048], [2048]),
               ("mixed", [1] * 32 + [512, 512], [2048] * 32 + [1024, 3072])]
    if quick:
        shapes, layouts = shapes[:1], layouts[:1] + layouts[3:4]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, kv_heads, group, head_dim in shapes:
        for layout, query_lens, seq_lens in layouts:
            block = 16
            blocks_per_seq = [math.ceil(n / block) for n in seq_lens]
            num_blocks = sum(blocks_per_seq)
            ids = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
            tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
            used = 0
            for s, n in enumerate(blocks_per_seq):
                tables[s, :n] = ids[used : used + n]
                used += n
            starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
            shape = (num_blocks, block, kv_heads, head_dim)
            k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
            v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
            q = torch.randn(sum(query_lens), kv_heads * group, head_dim, device="cuda", generator=gen,
                            dtype=torch.bfloat16)
            args = (q, k, v, tables, starts, lens, head_dim**-0.5, None)
            out, ref = paged_attention(*args), paged_attention_ref(*args)
            torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
            triton_ms = do_bench(partial(paged_attention, *args), quick)
            ref_ms = do_bench(partial(paged_attention_ref, *args), quick)
            kv_bytes = 2 * sum(seq_lens) * kv_heads * head_dim * 2
            rows.append({"kernel": "paged_attention", "model": name, "layout": layout, "seqs": len(seq_lens),
                         "tokens": sum(query_lens), "context": max(seq_lens), "triton_ms": triton_ms,
                         "torch_ref_ms": ref_ms, "speedup": ref_ms / triton_ms,
                         "kv_GBps": kv_bytes / triton_ms / 1e6})
            print(f"  attention {name} {layout} {len(seq_lens)} seqs: {triton_ms:.3f} ms", flush=True)
    return rows


def lora_rows(quick: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    sizes = (4096, 1024, 1024)
    weights = LoRAStackedWeights.allocate(NUM_SLOTS, MAX_RANK, 4096, sizes, torch.bfloat16, "cuda")
    for slot in range(NUM_SLOTS):
        r = RANKS[slot % 3]
        weights.write_slot(slot, [torch.randn(r, 4096, generator=gen) * 0.02 for _ in sizes],
                           [torch.randn(n, r, generator=gen) * 0.02 for n in sizes], 2.0)
    layouts = [("decode", 1), ("decode", 16), ("decode", 64), ("decode", 256), ("prefill", 2048)]
    if quick:
        layouts = [("decode", 64), ("prefill", 2048)]
    rows = []
    for layout, tokens in layouts:
        for mix in MIXES:
            slots = _slots(mix, layout, tokens, gen)
            x = (torch.randn(len(slots), 4096, generator=gen) * 0.05).bfloat16().cuda()
            y = torch.randn(len(slots), sum(sizes), generator=gen).bfloat16().cuda()
            meta = LoRABatchMeta.build(slots, device="cuda")
            token_slots = meta.token_slots
            expected = y.clone()
            add_lora_ref(expected, x, weights, token_slots)
            times: dict[str, float] = {}

            for mode, segments in (("tokens", False), ("segments", True)):
                out = y.clone()
                lora_triton.add_lora(out, x, weights, meta, segments)
                err = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
                assert err < 2e-2, f"{mode} {layout} {mix}: relative error {err:.3g}"
                times[mode] = do_bench(partial(lora_triton.add_lora, y, x, weights, meta, segments), quick)
            times["auto"] = do_bench(partial(add_lora, y, x, weights, meta), quick)
            times["torch_ref"] = do_bench(partial(add_lora_ref, y, x, weights, token_slots), quick)
            rows.append({"kernel": "add_lora qkv", "layout": layout, "mix": mix, "tokens": len(slots),
                         "active": len(meta.active_slots), "mean_segment": round(meta.mean_segment_len, 1),
                         **{f"{k}_ms": v for k, v in times.items()},
                         "faster_mode": min(("tokens", "segments"), key=lambda m: times[m])})
            print(f"  lora {layout} {tokens} {mix}: tokens {times['tokens']:.3f} ms, segments "
                  f"{times['segments']:.3f} ms", flush=True)
    return rows


def _slots(mix: str, layout: str, tokens: int, gen: torch.Generator) -> list[int]:
    requests = tokens if layout == "decode" else 8
    if mix == "distinct":
        per_request = [i % NUM_SLOTS for i in range(requests)]
    elif mix == "identical":
        per_request = [NUM_SLOTS - 1] * requests
    elif mix == "uniform":
        per_request = torch.randint(0, NUM_SLOTS, (requests,), generator=gen).tolist()
    else:
        tail = torch.randint(1, NUM_SLOTS, (requests,), generator=gen)
        per_request = torch.where(torch.rand(requests, generator=gen) < 0.7, 0, tail).tolist()
    if layout == "decode":
        return per_request
    return [s for s in per_request for _ in range(tokens // requests)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_kernels needs a CUDA device")
    torch.manual_seed(0)
    with torch.inference_mode():
        attention, lora = attention_rows(args.quick), lora_rows(args.quick)
    print_table(f"paged attention, bf16, {torch.cuda.get_device_name()}", attention,
                ["model", "layout", "seqs", "tokens", "context", "triton_ms", "torch_ref_ms", "speedup", "kv_GBps"])
    print_table(f"LoRA q|k|v (hidden 4096, ranks 8/16/64 mixed, {NUM_SLOTS} slots), bf16", lora,
                ["layout", "mix", "tokens", "active", "mean_segment", "tokens_ms", "segments_ms", "auto_ms",
                 "torch_ref_ms", "faster_mode"])
    write_json("gpu_kernels", {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                               "quick": args.quick, "attention": attention, "lora": lora})


if __name__ == "__main__":
    main()
