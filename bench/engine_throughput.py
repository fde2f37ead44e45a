"""Engine throughput vs HF transformers on the SmolLM-135M-shaped bench model (printed, not asserted).

(a) a mixed workload submitted at once: output tokens/s, TTFT p50/p99, ms per output token, ratio to
    transformers `generate` run the way a user would (batches in arrival order, left-padded);
(b) decode-only tokens/s at batch 1 and 32, fp32 and bf16, next to the machine's measured roofline
    (GEMM GFLOP/s at the model's decode shapes and memory bandwidth).

    python -m bench.engine_throughput [--quick]     (from the repository root)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import bench_model, left_padded, percentile, print_table, timed, workload, write_json
from engine import SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine


def run_engine(model: Path, reqs: list[tuple[list[int], int]], dtype: str) -> dict:
    engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, kv_cache_memory_gb=2.0, max_num_seqs=64,
                                    max_num_batched_tokens=2048))
    submitted, first, done = {}, {}, {}
    t0 = time.perf_counter()
    for i, (prompt, n_out) in enumerate(reqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True))
        submitted[f"r{i}"] = time.perf_counter()
    n_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas: this step's new tokens of each request
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            n_tokens += sum(len(s.token_ids) for s in out.samples)
            if out.finished:
                done[out.request_id] = now
    wall = time.perf_counter() - t0
    ttft = [first[r] - submitted[r] for r in submitted]
    tpot = [(done[r] - first[r]) * 1000 / max(1, n - 1) for r, (_, n) in zip(submitted, reqs, strict=True)]
    return {"system": "loraplex", "dtype": dtype, "output_tok_s": n_tokens / wall, "wall_s": wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "ms_per_output_token": percentile(tpot, 50), "preemptions": engine.scheduler.stats.num_preemptions}


def run_transformers(model: Path, reqs: list[tuple[list[int], int]], dtype: str, batch: int) -> dict:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    pad = 0
    t0 = time.perf_counter()
    ttft, n_tokens = [], 0
    for start in range(0, len(reqs), batch):
        group = reqs[start : start + batch]
        ids, mask, max_new = left_padded(group, pad)
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                        do_sample=False, pad_token_id=pad)
        # a user's request is answered when its batch finishes; every arrival was at t0
        ttft += [time.perf_counter() - t0] * len(group)
        n_tokens += sum(n for _, n in group)
    wall = time.perf_counter() - t0
    return {"system": f"transformers (batch {batch})", "dtype": dtype, "output_tok_s": n_tokens / wall,
            "wall_s": wall, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


def decode_only(model: Path, batch: int, dtype: str, steps: int) -> float:
    """Steady-state decode tokens/s with `batch` running sequences (prefill excluded)."""
    engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, kv_cache_memory_gb=1.0, max_num_seqs=batch))
    for i in range(batch):
        engine.add_request(f"d{i}", {"prompt_token_ids": [100 + i] * 64},
                           SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()) or \
            engine.scheduler.waiting:
        engine.step()
    engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return batch * steps / (time.perf_counter() - t)


def hf_decode_only(model: Path, batch: int, dtype: str, steps: int) -> float:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
    ids = torch.full((batch, 64), 100)

    def gen(n: int) -> None:
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    short, long = timed(lambda: gen(2), 1), timed(lambda: gen(2 + steps), 1)
    return batch * steps / max(1e-9, long - short)


def roofline(dtype: torch.dtype, hidden: int, inter: int, rows: int) -> dict:
    """GEMM GFLOP/s at the decode shapes of the model, and memory bandwidth (GB/s)."""
    x = torch.randn(rows, hidden, dtype=dtype)
    w1, w2 = torch.randn(2 * inter, hidden, dtype=dtype), torch.randn(hidden, inter, dtype=dtype)
    a = torch.randn(rows, inter, dtype=dtype)

    def gemm() -> None:
        for _ in range(10):
            torch.nn.functional.linear(x, w1)
            torch.nn.functional.linear(a, w2)

    t = timed(gemm)
    flops = 10 * 2 * rows * (2 * inter * hidden + hidden * inter)
    big = torch.empty(64 * 1024 * 1024 // 4, dtype=torch.float32)
    dst = torch.empty_like(big)
    bw_t = timed(lambda: dst.copy_(big))
    return {"gemm_gflops": flops / t / 1e9, "mem_bw_gbs": 2 * big.numel() * 4 / bw_t / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller workload (about a minute)")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers side")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = bench_model()
    mc = ModelConfig.from_pretrained(model)
    n, prompts, outs = (16, (64, 256), (16, 64)) if args.quick else (64, (64, 512), (16, 256))
    reqs = workload(n, prompts, outs, mc.vocab_size, seed=0)
    rows = [run_engine(model, reqs, "float32")]
    if not args.skip_hf:
        rows.append(run_transformers(model, reqs, "float32", batch=16))
        rows[0]["ratio_vs_hf"] = rows[0]["output_tok_s"] / rows[1]["output_tok_s"]
    print_table(f"(a) {n} requests at once, prompts {prompts}, outputs {outs} (CPU, fp32)", rows,
                ["system", "dtype", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "ms_per_output_token",
                 "wall_s", "preemptions", "ratio_vs_hf"])

    steps = 8 if args.quick else 32
    decode_rows = []
    for dtype in ("float32", "bfloat16"):
        tdt = getattr(torch, dtype)
        for batch in (1, 32):
            ours = decode_only(model, batch, dtype, steps)
            row = {"dtype": dtype, "batch": batch, "loraplex_tok_s": ours, "ms_per_step": 1000 * batch / ours}
            if not args.skip_hf:
                row["transformers_tok_s"] = hf_decode_only(model, batch, dtype, steps)
                row["ratio_vs_hf"] = ours / row["transformers_tok_s"]
            rl = roofline(tdt, mc.hidden_size, mc.intermediate_size, batch)
            params = sum(p.numel() for p in [torch.empty(mc.vocab_size, mc.hidden_size)]) + mc.num_layers * (
                mc.hidden_size * (mc.q_size + 2 * mc.kv_size) + mc.q_size * mc.hidden_size
                + 3 * mc.hidden_size * mc.intermediate_size)
            row["gemm_gflops"] = rl["gemm_gflops"]
            row["mem_bw_gbs"] = rl["mem_bw_gbs"]
            row["roofline_tok_s"] = min(rl["gemm_gflops"] * 1e9 / (2 * params),
                                        rl["mem_bw_gbs"] * 1e9 / (params * tdt.itemsize) * batch)
            decode_rows.append(row)
    print_table("(b) decode only (CPU)", decode_rows,
                ["dtype", "batch", "loraplex_tok_s", "ms_per_step", "transformers_tok_s", "ratio_vs_hf",
                 "gemm_gflops", "mem_bw_gbs", "roofline_tok_s"])
    write_json("engine_throughput", {"workload_a": rows, "decode_b": decode_rows, "quick": args.quick})


if __name__ == "__main__":
    main()
