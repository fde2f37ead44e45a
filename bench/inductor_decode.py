"""Does torch.compile (Inductor, CPU) speed up a decode step? Eager vs compiled, same model, same inputs.

The measurement behind keeping the CPU decode path eager (engine/decode_graph.py, docs/benchmarks.md):
one decode step of the bench model for a batch of B sequences with a few blocks of context, written as
one tensor-only function (what a bucketed, compiled step would run: the same ops as
engine.models.llama.LlamaModel.forward's decode rows, attention included), run eagerly and through
`torch.compile(dynamic=False, fullgraph=True)` with and without Inductor's weight freezing. Dense
weights (F.linear): oneDNN-prepacked weights are opaque tensors Dynamo cannot trace. Prints compile
seconds and ms per step; writes bench/results/inductor_decode.json.

    python -m bench.inductor_decode [--batch 1] [--dtype bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from bench.common import bench_model, print_table, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ["LORAPLEX_CPU_PREPACK"] = "0"  # dense weights: Dynamo cannot trace oneDNN's opaque tensors
    torch.set_num_threads(args.threads)
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.models.llama import rms_norm

    engine = LLMEngine(EngineConfig(model=str(bench_model()), dtype=args.dtype, kv_cache_memory_gb=0.25,
                                    enable_prefix_caching=False))
    m, cfg, kv = engine.runner.model, engine.runner.model.cfg, engine.runner.kv_caches
    g = cfg.num_heads // cfg.num_kv_heads

    def step(input_ids, positions, slot_mapping, blocks, masked):
        b, length = input_ids.shape[0], masked.shape[1]
        cos, sin = m.rotary.tables(positions)
        x = F.embedding(input_ids, m.embed)
        for i, layer in enumerate(m.layers):
            qkv = F.linear(rms_norm(x, layer.input_norm, cfg.rms_norm_eps), layer.qkv)
            v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(b, cfg.num_kv_heads, cfg.head_dim)
            qk = qkv[:, :cfg.q_size + cfg.kv_size].reshape(b, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            q, k = m.rotary.apply(qk, cos, sin).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            k_cache, v_cache = kv[i]
            k_cache.flatten(0, 1).index_copy_(0, slot_mapping, k)
            v_cache.flatten(0, 1).index_copy_(0, slot_mapping, v)
            keys = k_cache.permute(2, 0, 1, 3).index_select(1, blocks).reshape(cfg.num_kv_heads * b, length, -1)
            vals = v_cache.permute(2, 0, 1, 3).index_select(1, blocks).reshape(cfg.num_kv_heads * b, length, -1)
            qd = q.view(b, cfg.num_kv_heads, g, -1).transpose(0, 1).reshape(cfg.num_kv_heads * b, g, -1)
            s = torch.bmm(qd.float(), keys.float().transpose(1, 2)).view(cfg.num_kv_heads, b, g, length)
            p = torch.softmax((s * m.scale).masked_fill(masked[None, :, None, :], float("-inf")), -1)
            a = torch.bmm(p.view(cfg.num_kv_heads * b, g, length), vals.float())
            a = a.view(cfg.num_kv_heads, b, g, -1).transpose(0, 1).reshape(b, cfg.q_size).to(x.dtype)
            x = x + F.linear(a, layer.o)
            gate, up = F.linear(rms_norm(x, layer.post_norm, cfg.rms_norm_eps), layer.gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.linear(rms_norm(x, m.norm, cfg.rms_norm_eps), m.lm_head).float()

    b, nb, bs = args.batch, 4, engine.config.block_size
    inputs = (torch.arange(b) + 10, torch.full((b,), 40), torch.arange(b) * bs * nb + 40, torch.arange(b * nb),
              torch.arange(nb * bs)[None, :].expand(b, -1) > 40)

    def per_step(fn, n: int = 20) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn(*inputs)
        return (time.perf_counter() - t) / n * 1000

    rows = []
    with torch.inference_mode():
        reference = step(*inputs)
        rows.append({"path": "eager", "compile_s": 0.0, "ms_per_step": per_step(step), "max_abs_diff": 0.0})
        import torch._inductor.config as inductor_config

        for freezing in (False, True):
            torch._dynamo.reset()
            inductor_config.freezing = freezing
            compiled = torch.compile(step, dynamic=False, fullgraph=True)
            t = time.perf_counter()
            out = compiled(*inputs)
            took = time.perf_counter() - t
            rows.append({"path": "inductor" + (" + freezing" if freezing else ""), "compile_s": took,
                         "ms_per_step": per_step(compiled), "max_abs_diff": (out - reference).abs().max().item()})
    print_table(f"one decode step, batch {b}, {args.dtype}, {args.threads} thread(s), CPU", rows,
                ["path", "compile_s", "ms_per_step", "max_abs_diff"])
    write_json("inductor_decode", {"rows": rows, "batch": b, "dtype": args.dtype, "threads": args.threads})


if __name__ == "__main__":
    main()
