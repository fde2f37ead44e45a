"""loraplex's native CPU ops (kernels/csrc/cpu_ops.cpp), built once per machine and loaded on demand.

The CPU decode step is many small ops: at batch 1 each layer's RMSNorms, residual adds, SiLU-and-multiply
and the attention over a few hundred cached keys are ~40 dispatches of microseconds each, and at batch 32
the torch attention path copies every sequence's keys and values out of the paged cache, per layer, per
step, before it multiplies them (about a third of a long-context step, docs/benchmarks.md). These ops do
that work in one pass each, reading the paged cache in place, the way vLLM's CPU build and llama.cpp do
it in C++. Each has a torch twin (kernels/fused.py, kernels/attention.py) that it must match and that runs
wherever the ops are not built (CUDA tensors, no compiler, LORAPLEX_CPU_NATIVE=0).

    decode_attention(q, k_cache, v_cache, block_tables, seq_ids, seq_lens, scale, window) -> (B, H_q, D)
        Semantics: row b is sequence seq_ids[b]'s one query token, at position seq_lens[s] - 1; it
        attends keys max(0, len - window) .. len - 1 (all when window <= 0) read through block_tables[s]:
        out[b, h] = softmax_j(scale * q[b, h] . K[j, h // G]) @ V[j, h // G], fp32 accumulation, in
        q's dtype. Caches (num_blocks, block_size, H_kv, D) with any block/slot/head strides. Over a finer
        cache, q as kernels.attention.scoring_query rounds it; over bf16 values the softmax is rounded
        to bf16 before it weighs them (the torch reference's rounding). Work goes head by head, and within
        a head the rows whose sequences start in the same block (a shared cached prefix) one after the
        other, so their shared keys and values are read from memory once and then from cache. AVX2
        builds (head_dim 64 or 128, float32 or bf16 caches, no window) go further: rows whose tables share
        64 keys or more from position 0 on are scored against that prefix together, one pass per group and
        kv head (cascade attention), and each row's own pass over the rest merges the prefix's softmax
        state; such rows keep their probabilities in fp32 over a bf16 cache (has_shared_prefix_decode).
    prefill_attention(q, k_cache, v_cache, table, seq_len, scale, window) -> (n, H_q, D)
        Semantics: q's n rows are one sequence's last n positions seq_len - n .. seq_len - 1; row i attends
        keys max(0, p - window + 1) .. p (all from 0 when window <= 0) read through `table` (its blocks),
        as decode_attention. AVX-512 or AVX2 builds, head_dim 64 or 128 (has_prefill_attention); bf16 q over
        bf16 caches runs its two products on AMX tiles where the CPU has them (P rounded to bf16). AVX2
        builds compute in fp32 throughout: bf16 q over an int8 cache runs as float32 q over rows widened to
        float32 (the reference's values), rounded to bf16 at the end.
    add_rms_norm(residual, delta, weight, eps) -> out
        Semantics: residual += delta (in place, rounded to residual's dtype; skipped when delta is None),
        then out = weight * (residual.float() * rsqrt(mean(residual.float()^2) + eps)).to(dtype).
        Where the CPU has AVX512-BF16, the ops' vector bf16 stores (these among them) round by its
        conversion instruction: as torch rounds, except that fp32 denormals (below 1.2e-38) become zeros.
    silu_mul(x) -> (rows, I)
        Semantics: F.silu(x[:, :I]) * x[:, I:] for x (rows, 2I), each op rounded to x's dtype.
    silu_linear(x, w, scales, n) -> (rows, n / 2)
        Semantics: silu_mul(y) for y = x @ W.T of a fused gate/up projection W (n, K) in native panels
        (any kind layer_forward takes), no bias; equal to the two ops bit for bit. On AMX tiles (bf16 x over
        bf16 panels or w8a8 quads, n / 2 a multiple of 16) the product's epilogue computes it, so the
        (rows, n) product is never written.
    bf16_linear / f32_linear / int8_linear / int4_linear / w8a8_linear / w4a8_linear, lora_add
        The panel GEMMs and the batched LoRA add: semantics in kernels.dense_cpu and kernels.lora_cpu.
        bf16 x (bf16, int8, int4 panels): AVX512-BF16 builds; float32 x (f32 and int8 panels): AVX-512 or
        AVX2 builds (has_f32_linear, has_int8_linear_f32); w8a8 (int8 x int8): AVX512-VNNI for bf16 x,
        AVX2 for bf16 and float32 x (has_w8a8_linear, has_w8a8_linear_f32); w4a8 (int4 x int8): AVX2
        builds, its products by AVX512-VNNI where the CPU has them (set_w4a8_vnni(False) runs the AVX2
        kernels, which give the same bits). One or two rows of bf16 or int8 panels or w8a8 quads (a
        decode step's batch) stream their weights in runs of up to 8 panels side by side, as many runs in
        each thread's share; more rows run 6-row tiles over groups of 4. Both sum in the same order, so a
        row's product does not depend on the batch (set_stream_rows(0) runs 1 or 2 rows on the tiles).
    layer_forward(x, h, <the layer's projections>, ..., lora operands) -> next h
        Semantics: one decoder layer of a step, exactly the ops above in the order engine/models/llama.py's
        layer loop calls them (their twins where the op is not built), LoRA adds included: one Python call
        per layer instead of nine to thirteen. Attention as kernels.attention.paged_attention_native: the
        decode rows by decode_attention (every row when decode_rows is None), each prefill chunk (first
        row, end row, sequence) by prefill_attention. Where silu_linear runs on AMX
        tiles, a step's LoRA deltas on gate/up are computed first (in fp32) and added inside its epilogue
        where lora_add would add them to the stored product, so the result is op by op's bit for bit.
    layers_forward(x, h, weights, extras, ns, norms, ..., k_caches, v_caches, ..., lora, lora_groups) -> h
        Semantics: layer_forward for every layer in turn, each layer's arguments sliced from flat lists
        (the model's weight lists, built once; per step its caches and LoRA operands): one Python call
        per step instead of one per layer (on the bench model each call converted ~35 arguments, ~0.6 ms
        of an ~8.6 ms batch-1 w4a8 step on a Zen 1 CPU).

Threads: the GEMMs (panel groups), both attentions (row and head items) and lora_add (tiles of one slot's
tokens) start from the contiguous shares at::parallel_for would give each of torch's threads, and a thread
done with its share takes items from the far end of another's (parallel_stealing in the source). A thread that the OS deschedules mid-step (the
gateway or the HTTP client on its core, a neighbouring VM) then delays only the item it holds; with a static
split the other thread would wait out its whole share at the region's end. Every item is computed the same
way by whichever thread takes it, so results do not depend on the thread count or on who took what.

Built with the host's compiler flags (`-march=native`) into LORAPLEX_NATIVE_DIR (default
~/.cache/loraplex/native), under a name that hashes the source, the flags, torch's version and the CPU's
feature flags: a machine with another CPU, or a changed source, builds its own copy (~10 s with g++ and
ninja; scripts/setup.sh does it ahead of the first request). If the build fails the reason is logged once
and every op runs its torch twin.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from kernels.cpu_features import CPUINFO, cpu_flags

NATIVE_ENV = "LORAPLEX_CPU_NATIVE"  # "0": run every op's torch twin (for A/B measurements)
DIR_ENV = "LORAPLEX_NATIVE_DIR"
SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp")  # OpenMP: at::parallel_for runs on torch's own libgomp
LDFLAGS = ("-fopenmp",)

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ops": the loaded op namespace or None; "error": why not


def build_name() -> str:
    """The library's name for this source, these flags, this torch and this CPU."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(torch.__version__.encode())
    with contextlib.suppress(OSError):
        h.update(" ".join(sorted(cpu_flags(CPUINFO.read_text()))).encode())
    return "loraplex_cpu_" + h.hexdigest()[:16]


def build_dir() -> Path:
    base = os.environ.get(DIR_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache",
                                                    "loraplex", "native")
    return Path(base) / build_name()


def enabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1") != "0"


def ops() -> Any | None:
    """`torch.ops.loraplex_cpu` once the library is built and loaded; None when disabled or unbuildable."""
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load() if enabled() else None
    return _state["ops"]


def loaded_name() -> str | None:
    """The name of the library this process loaded (None before, or if it did not load)."""
    return _state.get("name")


def error() -> str | None:
    """Why the ops are not available (None if they are, or were never asked for)."""
    return _state.get("error")


def _load() -> Any | None:
    try:
        from torch.utils import cpp_extension

        name, directory = build_name(), build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        # copies: load() appends to the flag lists it is given
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           build_directory=str(directory), is_python_module=False, verbose=False)
        _state["name"] = name
        return torch.ops.loraplex_cpu
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the torch twins still run
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        _state["error"] = f"{type(exc).__name__}: {first}"[:500]
        log.warning("native CPU ops unavailable, using the torch path: %s", _state["error"])
        return None


def available_for(t: torch.Tensor) -> Any | None:
    """The op namespace if `t` (a CPU tensor in float32 or bfloat16) can run the native ops, else None."""
    if not t.is_cpu or t.dtype not in _NATIVE_DTYPES:
        return None
    return _state["ops"] if "ops" in _state else ops()


def main() -> int:
    """`python -m kernels.native_cpu`: build (or find) the library now; exit 1 if it cannot be built."""
    logging.basicConfig(level=logging.INFO)
    if not enabled():
        print(f"native CPU ops: disabled ({NATIVE_ENV}=0)")
        return 0
    if ops() is None:
        print(f"native CPU ops: not built ({error()})")
        return 1
    print(f"native CPU ops: ready ({build_dir()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
