"""Weight-only quantization on the CPU: fp32, bf16, int8 and int4 on the SmolLM-135M-shaped bench model.

(a) the engine: batch-1 decode ms/token, batch-32 decode tokens/s, prefill tokens/s, resident weight bytes;
(b) the linear ops at the model's shapes (fused q|k|v, o, gate|up, down, lm_head) and 1 / 32 / 512 tokens:
    fp32 and bf16 F.linear, torch's packed int8/int4 kernels with bf16 activations, and what
    `kernels.quant.linear` dispatches to (kernels.quant_cpu picks per call by these measurements).
Printed, not asserted; JSON in bench/results/quantization.json.

    python -m bench.quantization [--quick]     (from the repository root)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import bench_model, print_table, write_json
from engine import SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from kernels import quant

CONFIGS: dict[str, dict] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "bfloat16", "quantization": "int8"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},  # group size: the largest that fits (64 here)
}


def engine_for(model: Path, name: str, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory_gb=0.25, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=2048, enable_prefix_caching=False, **CONFIGS[name]))


def decode_step_s(model: Path, batch: int, steps: int) -> dict[str, float]:
    """Median wall time of one decode step with `batch` running sequences, per config (prefill excluded).

    The four engines step in turn, so a burst of other work on a shared machine slows all of them alike,
    and the median drops the steps it hit.
    """
    engines = {name: engine_for(model, name, batch) for name in CONFIGS}
    for engine in engines.values():
        for i in range(batch):
            engine.add_request(f"d{i}", {"prompt_token_ids": [100 + i] * 64},
                               SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.requests.values()):
            engine.step()
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def prefill_tok_s(model: Path, prompts: int, length: int, repeat: int) -> tuple[dict[str, float], dict[str, int]]:
    """Prompt tokens/s per config of `prompts` prompts of `length` tokens (best of `repeat` rounds, the
    engines in turn; prefix caching off so every round computes them), and each engine's weight bytes."""
    engines = {name: engine_for(model, name, prompts) for name in CONFIGS}
    best = dict.fromkeys(engines, float("inf"))
    for r in range(repeat + 1):  # the first round warms up
        for name, engine in engines.items():
            vocab = engine.model_config.vocab_size
            t = time.perf_counter()
            for i in range(prompts):
                ids = [(37 * i + 11 * j) % (vocab - 10) + 10 for j in range(length)]
                engine.add_request(f"p{r}-{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            if r:
                best[name] = min(best[name], time.perf_counter() - t)
    return ({name: prompts * length / t for name, t in best.items()},
            {name: engine.runner.weight_bytes for name, engine in engines.items()})


def op_rows(mc: ModelConfig, token_counts: tuple[int, ...], rounds: int) -> list[dict]:
    """µs per call (min over `rounds`) of each way to run one linear layer of the model."""
    h, i = mc.hidden_size, mc.intermediate_size
    shapes = {"qkv": (mc.q_size + 2 * mc.kv_size, h), "o": (h, mc.q_size), "gate_up": (2 * i, h),
              "down": (h, i), "lm_head": (mc.vocab_size, h)}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.02
        w8 = quant.quantize_int8(w, torch.bfloat16)
        w4 = quant.place(quant.quantize_int4(w, 64, torch.bfloat16), "cpu")
        if not isinstance(w4, quant.Int4Weight) or w4.layout != "cpu_int4pack":
            raise RuntimeError("this torch build has no packed int4 CPU kernel")
        w_bf16 = w.bfloat16()
        for tokens in token_counts:
            x = torch.randn(tokens, k, generator=gen)
            xb = x.bfloat16()
            candidates: dict[str, tuple[Callable, tuple]] = {
                "fp32_linear": (F.linear, (x, w)),
                "bf16_linear": (F.linear, (xb, w_bf16)),
                "int8_packed": (torch.ops.aten._weight_int8pack_mm, (xb, w8.qweight, w8.scales)),
                "int4_packed": (torch.ops.aten._weight_int4pack_mm_for_cpu, (xb, w4.qweight, 64, w4.scale_zeros)),
                "int8_dispatch": (quant.linear, (xb, w8)),
                "int4_dispatch": (quant.linear, (xb, w4)),
            }
            best = _interleaved_min_us(candidates, rounds if tokens < 512 else max(6, rounds // 8))
            rows.append({"layer": name, "shape": f"{n}x{k}", "tokens": tokens, **best})
    return rows


def _interleaved_min_us(candidates: dict[str, tuple[Callable, tuple]], rounds: int) -> dict[str, float]:
    """µs per call of each candidate, the min over `rounds` rounds that each run every candidate once (so a
    burst of other work on a shared machine cannot land on one candidate's whole window)."""
    best = dict.fromkeys(candidates, float("inf"))
    for fn, fn_args in candidates.values():
        fn(*fn_args)
    for _ in range(rounds):
        for label, (fn, fn_args) in candidates.items():
            t = time.perf_counter()
            fn(*fn_args)
            best[label] = min(best[label], time.perf_counter() - t)
    return {label: 1e6 * t for label, t in best.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps, repeats and op rounds (a few minutes)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a machine whose cores are busy with other work, "
                         "more threads than free cores make OpenMP's barriers dominate: measured 33x slower)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = bench_model()
    mc = ModelConfig.from_pretrained(model)
    steps, repeat = (16, 3) if args.quick else (48, 5)
    prompts, length = 2, 512
    prefill, weight_bytes = prefill_tok_s(model, prompts, length, repeat)
    one, many = decode_step_s(model, 1, steps), decode_step_s(model, 32, steps)
    rows = [{"config": name, "weight_MiB": weight_bytes[name] / 2**20, "decode_b1_ms_per_token": 1000 * one[name],
             "decode_b32_tok_s": 32 / many[name], "prefill_tok_s": prefill[name]} for name in CONFIGS]
    threads = torch.get_num_threads()
    print_table(f"(a) engine, CPU, {threads} threads (configs interleaved; prefill: {prompts} x {length} tokens, best "
                f"of {repeat}; decode: median of {steps} steps)",
                rows, ["config", "weight_MiB", "decode_b1_ms_per_token", "decode_b32_tok_s", "prefill_tok_s"])
    ops = op_rows(mc, (1, 32, 512), 20 if args.quick else 100)
    print_table(f"(b) one linear layer, µs per call (min of interleaved rounds), {threads} threads", ops,
                ["layer", "shape", "tokens", "fp32_linear", "bf16_linear", "int8_packed", "int4_packed",
                 "int8_dispatch", "int4_dispatch"])
    write_json("quantization", {"engine": rows, "ops": ops, "quick": args.quick, "int4_group_size": 64})


if __name__ == "__main__":
    main()
