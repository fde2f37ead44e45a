"""CPU multi-LoRA strategies, timed at the bench model's shapes (printed, not asserted).

One transformer layer's four LoRA groups of the SmolLM-135M-shaped bench model (qkv 576 -> 576|192|192, o
576 -> 576, gate_up 576 -> 1536|1536, down 1536 -> 576), 32 slots with ranks 8/16/64 mixed (max rank 64),
per batch layout (decode 1/8/32 tokens, a 512-token prefill of 8 requests, and a mixed step of a 480-token
prefill chunk plus 32 decode tokens), adapter mix (distinct/uniform/skewed/identical, as in the kernel
tests) and dtype (float32, bfloat16). Candidates:

    per_adapter_loop   the former CPU path: two matmuls and an index_add per slot and slice
    gather_bmm         per-token gather of the padded factors + batched matmul (kernels.lora.add_lora_ref,
                       which the engine called for small decode batches)
    segment_bmm        tokens sorted by slot and padded to the longest slot, ranks padded to the largest
                       active rank, one batched matmul per projection
    by_slot, packed,   kernels.lora_cpu's three strategies forced for every slot (packed and stacked as in
    stacked            steady decode, their copies cached; packed_cold: packing included)
    auto               kernels.lora_cpu.add_lora_cpu's choice (what kernels.lora.add_lora runs on CPU)
    auto_{M}x{P}       auto under the rule CpuRule(by_slot_min_tokens=M, packed_max_slots=P) for every
                       dtype, to check the measured constants (kernels.lora_cpu.RULES)

Each time is the minimum over interleaved rounds (order rotated each round) of one call per group;
"fastest" is the fastest of the fixed strategies and former paths, and auto_vs_fastest auto's time over
its time. Next to them the layer's base projections (x @ W.T of the four groups) for scale. The default clock is the CPU time of one thread
(torch.set_num_threads(1)), which other processes on a shared machine barely disturb; --threads N --clock
wall times what a quiet machine with N threads would see.

    python -m bench.lora_cpu_kernels [--quick]       (from the repository root)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from bench.common import print_table, write_json
from kernels import lora_cpu
from kernels.lora import add_lora_ref
from kernels.lora_meta import LoRABatchMeta
from kernels.lora_weights import LoRAStackedWeights

HIDDEN, INTERMEDIATE = 576, 1536
GROUPS = {"qkv": (HIDDEN, (576, 192, 192)), "o": (HIDDEN, (576,)), "gate_up": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
          "down": (INTERMEDIATE, (HIDDEN,))}
NUM_SLOTS, MAX_RANK, RANKS = 32, 64, (8, 16, 64)
MIXES = ("distinct", "uniform", "skewed", "identical")
Op = Callable[[torch.Tensor, torch.Tensor, LoRAStackedWeights, LoRABatchMeta], None]


def make_weights(dtype: torch.dtype) -> dict[str, LoRAStackedWeights]:
    """Every slot filled, slot s with rank RANKS[s % 3] on every slice."""
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, (in_features, sizes) in GROUPS.items():
        stacked = LoRAStackedWeights.allocate(NUM_SLOTS, MAX_RANK, in_features, sizes, dtype)
        for slot in range(NUM_SLOTS):
            rank = RANKS[slot % len(RANKS)]
            stacked.write_slot(slot, [torch.randn(rank, in_features, generator=gen) * 0.05 for _ in sizes],
                               [torch.randn(n, rank, generator=gen) * 0.05 for n in sizes], 2.0)
        weights[name] = stacked
    return weights


def request_slots(mix: str, num_requests: int, gen: torch.Generator) -> list[int]:
    """One slot per request, like tests/kernels/conftest.py's popular_slots over NUM_SLOTS slots."""
    if mix == "distinct":
        return [i % NUM_SLOTS for i in range(num_requests)]
    if mix == "identical":
        return [NUM_SLOTS - 1] * num_requests
    if mix == "uniform":
        return torch.randint(0, NUM_SLOTS, (num_requests,), generator=gen).tolist()
    tail = torch.randint(1, NUM_SLOTS, (num_requests,), generator=gen)  # skewed: 70 % on slot 0
    return torch.where(torch.rand(num_requests, generator=gen) < 0.7, 0, tail).tolist()


def token_slots(layout: str, mix: str, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if layout.startswith("decode"):
        return request_slots(mix, int(layout.removeprefix("decode")), gen)
    if layout == "prefill512":  # 8 requests of 64 tokens
        return [s for s in request_slots(mix, 8, gen) for _ in range(64)]
    slots = request_slots(mix, 33, gen)  # "mixed": a 480-token chunk of one request, then 32 decode tokens
    return [slots[0]] * 480 + slots[1:]


def per_adapter_loop(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> None:
    """The CPU path kernels.lora.add_lora had before kernels.lora_cpu."""
    ranks, scaling, stride = weights.ranks.tolist(), weights.scaling.tolist(), weights.max_rank
    for slot, rows in meta.slot_rows:
        x_rows = x[rows]
        for i, (offset, size) in enumerate(zip(weights.slice_offsets, weights.slice_sizes, strict=True)):
            rank = ranks[slot][i]
            if rank:
                delta = (x_rows @ weights.lora_a[slot, i * stride : i * stride + rank].T) @ \
                    weights.lora_b[slot, offset : offset + size, :rank].T
                if isinstance(rows, slice):
                    y[rows, offset : offset + size].add_(delta, alpha=scaling[slot][i])
                else:
                    y[:, offset : offset + size].index_add_(0, rows, delta, alpha=scaling[slot][i])


def gather_bmm(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> None:
    add_lora_ref(y, x, weights, meta.token_slots)


def segment_bmm(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> None:
    """Sorted segments padded to (slots, longest, H) and ranks to the largest active one; one bmm each way."""
    active = torch.tensor(meta.active_slots)
    rows = [torch.arange(r.start, r.stop) if isinstance(r, slice) else r for _, r in meta.slot_rows]
    num, longest, tokens = len(rows), max(len(r) for r in rows), x.shape[0]
    index = torch.full((num, longest), tokens, dtype=torch.int64)  # row `tokens` is a zero pad row
    for j, r in enumerate(rows):
        index[j, : len(r)] = r
    x_pad = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, index.flatten()).view(num, longest, -1)
    ranks = weights.ranks[active]  # (num, S)
    top = int(ranks.max())
    a = weights.lora_a[active].view(num, weights.num_slices, weights.max_rank, -1)[:, :, :top]  # (num, S, r, H)
    keep = (torch.arange(top)[None, None, :] < ranks[:, :, None]).to(x.dtype) * weights.scaling[active][:, :, None].to(x.dtype)
    shrunk = torch.einsum("nlh,nsrh->nslr", x_pad, a) * keep[:, :, None, :]  # (num, S, longest, r)
    out = x.new_zeros(num, longest, weights.out_features)
    for i, (offset, size) in enumerate(zip(weights.slice_offsets, weights.slice_sizes, strict=True)):
        b = weights.lora_b[active, offset : offset + size, :top]  # (num, n_i, r)
        out[:, :, offset : offset + size] = torch.bmm(shrunk[:, i], b.transpose(1, 2))
    padded = torch.cat([y, y.new_zeros(1, y.shape[1])])
    padded.index_add_(0, index.flatten(), out.view(num * longest, -1))
    y.copy_(padded[:tokens])


def _strategy(name: lora_cpu.Strategy) -> Op:
    return lambda y, x, w, meta: lora_cpu.add_lora_cpu(y, x, w, meta, name)


def _packed_cold(y: torch.Tensor, x: torch.Tensor, weights: LoRAStackedWeights, meta: LoRABatchMeta) -> None:
    weights.cpu_cache.clear()
    lora_cpu.add_lora_cpu(y, x, weights, meta, "packed")


def _auto_with(min_tokens: int, max_packed: int) -> Op:
    """auto under another rule (for both dtype classes), to check the measured constants."""
    rule = lora_cpu.CpuRule(min_tokens, max_packed)

    def run(y: torch.Tensor, x: torch.Tensor, w: LoRAStackedWeights, meta: LoRABatchMeta) -> None:
        saved = dict(lora_cpu.RULES)
        lora_cpu.RULES.update({key: rule for key in saved})
        try:
            lora_cpu.add_lora_cpu(y, x, w, meta)
        finally:
            lora_cpu.RULES.update(saved)
    return run


CANDIDATES: dict[str, Op] = {
    "per_adapter_loop": per_adapter_loop, "gather_bmm": gather_bmm, "segment_bmm": segment_bmm,
    "by_slot": _strategy("by_slot"), "packed": _strategy("packed"), "packed_cold": _packed_cold,
    "stacked": _strategy("stacked"), "auto": _strategy("auto"),
} | {f"auto_{m}x{p}": _auto_with(m, p) for m, p in ((4, 8), (8, 8), (8, 32), (16, 16), (32, 8), (32, 32))}
SLOW_ON_LONG = {"gather_bmm", "segment_bmm"}  # minutes on the 512-token layouts: timed on decode only
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def measure(layout: str, mix: str, dtype: torch.dtype, weights: dict[str, LoRAStackedWeights], rounds: int,
            candidates: list[str], clock: Callable[[], float]) -> dict:
    slots = token_slots(layout, mix)
    meta = LoRABatchMeta.build(slots)
    gen = torch.Generator().manual_seed(2)
    xs = {g: torch.randn(len(slots), w.in_features, generator=gen).to(dtype) for g, w in weights.items()}
    ys = {g: torch.zeros(len(slots), w.out_features, dtype=dtype) for g, w in weights.items()}
    base = {g: torch.randn(w.out_features, w.in_features, generator=gen).to(dtype) for g, w in weights.items()}
    names = [c for c in candidates if not (len(slots) > 64 and c in SLOW_ON_LONG)]
    names = [c for c in names if not (c.startswith("auto_") and layout == "decode1")]  # same as auto there
    expected = {}
    for g, w in weights.items():  # every candidate must agree with the reference twin
        expected[g] = torch.zeros_like(ys[g])
        add_lora_ref(expected[g], xs[g], w, meta.token_slots)
    for name in names:
        for g, w in weights.items():
            out = torch.zeros_like(ys[g])
            CANDIDATES[name](out, xs[g], w, meta)
            err = (out.float() - expected[g].float()).abs().max() / expected[g].float().abs().max()
            if err > 0.03:
                raise AssertionError(f"{name} {layout} {mix} {dtype} {g}: relative error {err:.3g}")

    def layer(op: Op) -> Callable[[], None]:
        # NOTE: each candidate gets its own buffers (sharing the tensors), so one's packs and stacks are
        # neither evicted nor warmed by another's: each is timed in its own steady state.
        own = {g: replace(w) for g, w in weights.items()}

        def run() -> None:
            for g, w in own.items():
                op(ys[g], xs[g], w, meta)
        return run

    def base_layer() -> None:
        for g in weights:
            xs[g] @ base[g].T

    runs = {"base": base_layer} | {n: layer(CANDIDATES[n]) for n in names}
    best = {n: float("inf") for n in runs}
    for fn in runs.values():
        fn()  # warm-up (and the packs of "packed")
    order = list(runs)
    for r in range(rounds):  # rotate the order: whoever runs right after a big copy finds cold caches
        for n in order[r % len(order):] + order[: r % len(order)]:
            start = clock()
            runs[n]()
            best[n] = min(best[n], clock() - start)
    row = {"dtype": str(dtype).removeprefix("torch."), "layout": layout, "mix": mix, "tokens": len(slots),
           "active": len(meta.active_slots), "base_us": best["base"] * 1e6}
    row |= {f"{n}_us": best[n] * 1e6 for n in names}
    fixed = [n for n in names if not n.startswith("auto")]  # the strategies and the former paths
    fastest = min(fixed, key=lambda n: best[n]) if fixed else "auto"
    row["fastest"] = fastest
    row["auto_vs_fastest"] = best["auto"] / best[fastest] if "auto" in best else None
    row["auto_overhead_vs_base"] = best["auto"] / best["base"] if "auto" in best else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and layouts (about a minute)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), help="cpu (thread CPU time, the default with one "
                    "thread) or wall (the default with more)")
    ap.add_argument("--name", default="lora_cpu_kernels", help="results file name under bench/results/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock_name = args.clock or ("cpu" if args.threads == 1 else "wall")
    if clock_name == "cpu" and args.threads != 1:
        ap.error("--clock cpu times one thread: use it with --threads 1")
    candidates = args.candidates.split(",")
    layouts = ("decode8", "decode32", "prefill512") if args.quick else ("decode1", "decode8", "decode32",
                                                                        "prefill512", "mixed")
    rounds = 5 if args.quick else 15
    rows = []
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            weights = make_weights(dtype)
            for layout in layouts:
                for mix in MIXES if layout != "decode1" else ("identical",):
                    row = measure(layout, mix, dtype, weights, rounds if layout.startswith("decode") else
                                  max(3, rounds // 3), candidates, CLOCKS[clock_name])
                    rows.append(row)
                    print(f"  {row['dtype']} {layout} {mix}: fastest {row['fastest']}, auto/fastest "
                          f"{row['auto_vs_fastest'] or float('nan'):.2f}", flush=True)
    columns = ["dtype", "layout", "mix", "tokens", "active", "base_us", *[f"{c}_us" for c in candidates],
               "fastest", "auto_vs_fastest", "auto_overhead_vs_base"]
    print_table(f"one layer's four LoRA groups, µs ({clock_name} clock, min of interleaved rounds, "
                f"{args.threads} thread(s))", rows, columns)
    write_json(args.name, {"rows": rows, "quick": args.quick, "threads": args.threads, "clock": clock_name,
                           "slots": NUM_SLOTS, "ranks": RANKS, "max_rank": MAX_RANK,
                           "groups": {g: [i, list(s)] for g, (i, s) in GROUPS.items()},
                           "rules": {k: vars(r) for k, r in lora_cpu.RULES.items()}})


if __name__ == "__main__":
    main()
