"""The engine's command-line flags, shared by `loraplex worker` and `loraplex serve` (which passes them on to
the worker it starts): one definition, so the two command lines cannot drift apart."""

from __future__ import annotations

import argparse


def add_engine_options(group: argparse._ArgumentGroup) -> None:
    """--device, --dtype, --kv-cache-dtype, --kv-cache-memory-gb, --max-num-seqs, --max-loras, --max-lora-rank,
    --quantization, --quantization-group-size, --quantize-lm-head, --decode-graphs (EngineConfig fields of the
    same names), and --threads (the worker process's intra-op threads)."""
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    group.add_argument("--dtype", default="auto")
    group.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "int8"), default="auto",
                       help="the KV cache's dtype (CPU): auto = the compute dtype; bfloat16 under float32 "
                            "compute; int8 rows with a float32 scale per slot and head (half of a bf16 "
                            "cache's bytes)")
    group.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-loras", type=int, default=8)
    group.add_argument("--max-lora-rank", type=int, default=64)
    group.add_argument("--quantization", choices=("none", "int8", "int4", "w8a8", "w4a8"), default="none",
                       help="quantization at load: weight-only int8 per output channel or int4 group-wise, "
                            "or w8a8 / w4a8 (int8 / int4 weights, activations rounded to int8 per token; "
                            "integer products where the CPU has VNNI or AVX2); a GPTQ checkpoint loads as "
                            "int4 (or w4a8) either way")
    group.add_argument("--quantization-group-size", type=int, default=None,
                       help="int4 / w4a8 group size: 32, 64, 128 or 256 (default: the largest of 128/64/32 "
                            "that fits)")
    group.add_argument("--quantize-lm-head", action="store_true",
                       help="with --quantization (or a GPTQ checkpoint): also hold a tied embedding table as "
                            "int8 per row, read by the embedding lookup and the lm_head (an untied lm_head is "
                            "quantized either way)")
    group.add_argument("--decode-graphs", choices=("auto", "on", "off"), default="auto",
                       help="decode steps through fixed-size buckets, replayed as CUDA graphs on a GPU "
                            "(auto: on for CUDA, off on the CPU)")
    group.add_argument("--threads", type=positive_int, default=None,
                       help="intra-op CPU threads of the worker (default: torch's, one per core). With "
                            "other busy processes on the same cores, fewer threads than cores avoids "
                            "OpenMP's spinning barriers stalling every step")


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def decode_graphs_value(choice: str) -> bool | None:
    """--decode-graphs as EngineConfig.decode_graphs."""
    return {"auto": None, "on": True, "off": False}[choice]
