"""Compile every Triton kernel variant ahead of time for sm_80 and sm_90: no GPU needed.

    python -m kernels.triton_aot [--jobs 2] [--arch 80,90] [--kernel NAME] [--tier full|default] [--json PATH]

Compiles each variant the dispatch can launch (`compile_variants()` of every kernels.*_triton module:
attention, LoRA, quantized matmul) with `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`, Triton's
own ptxas included, prints one row per (kernel, config, dtype, target) with the shared memory, registers
and spills of the cubin, and exits 1 when a variant fails to compile, spills registers or needs more shared
memory than the target has. Registers and spills come from ptxas's own report (Triton reads them from the
loaded binary, which needs a device).

NOTE: needs compiled kernels, so TRITON_INTERPRET must be unset, and a fresh Triton cache: a kernel found
in the cache is not compiled again, which would hide a compile error. The CLI compiles into a new temporary
directory, or into TRITON_CACHE_DIR when that is set, and then refuses to start unless it is empty.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import os
import pkgutil
import re
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from kernels.launch_config import KernelVariant

# Shared memory one block may use (opt-in maximum), by compute capability: A100 163 KiB, H100/H200 227 KiB
# (CUDA C Programming Guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_LIMIT = {80: 166_912, 90: 232_448}
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class CompileReport:
    """What compiling one variant for one target produced (error set when it did not compile)."""

    kernel: str
    config: str
    dtype: str
    arch: int
    shared: int  # bytes of shared memory per block (metadata.shared)
    n_regs: int  # registers per thread
    n_spills: int  # bytes of spill stores
    seconds: float
    error: str | None = None

    @property
    def problems(self) -> list[str]:
        if self.error is not None:
            return [f"does not compile: {self.error}"]
        found = []
        if self.n_spills:
            found.append(f"spills {self.n_spills} bytes of registers ({self.n_regs} registers)")
        if self.shared > SHARED_MEMORY_LIMIT[self.arch]:
            found.append(f"needs {self.shared} bytes of shared memory, sm_{self.arch} has "
                         f"{SHARED_MEMORY_LIMIT[self.arch]}")
        return found


def triton_modules() -> list[str]:
    """Every kernels.*_triton module: each must export compile_variants() covering all its kernels."""
    import kernels

    return sorted(f"kernels.{m.name}" for m in pkgutil.iter_modules(kernels.__path__) if m.name.endswith("_triton"))


@functools.cache
def all_variants() -> tuple[KernelVariant, ...]:
    """Every variant the Triton dispatch can launch, in a fixed order.

    Raises RuntimeError when a kernels.*_triton module has no compile_variants() or one of its @triton.jit
    kernels has no variant: a kernel the check does not compile must not exist.
    """
    from triton import knobs
    from triton.runtime.jit import JITFunction

    if knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreted and cannot be compiled")
    unique: dict[tuple, KernelVariant] = {}  # two table entries may share one launch: compile it once
    for name in triton_modules():
        module = importlib.import_module(name)
        listed = getattr(module, "compile_variants", None)
        if listed is None:
            raise RuntimeError(f"{name} has no compile_variants(): its kernels would escape the compile check")
        variants = listed()
        kernels = {v for v in vars(module).values() if isinstance(v, JITFunction) and v.__module__ == name}
        if missing := sorted(k.__name__ for k in kernels - {v.kernel for v in variants}):
            raise RuntimeError(f"{name}.compile_variants() lists no variant of {missing}")
        for v in variants:
            unique.setdefault((v.name, v.dtype, v.signature, tuple(sorted(v.constexprs.items())), v.config), v)
    return tuple(unique.values())


def compile_variant(variant: KernelVariant, arch: int) -> CompileReport:
    """Compile one variant for sm_`arch`; never raises for a compile error (it lands in the report)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(variant.signature)
    # Pointers 16-byte aligned, as torch allocations are and as the JIT specializes them.
    attrs = {(i,): [["tt.divisibility", 16]] for i, (_, kind) in enumerate(variant.signature) if kind[0] == "*"}
    options = {"num_warps": variant.config.num_warps, "num_stages": variant.config.num_stages,
               "enable_fp_fusion": True}
    base: dict[str, Any] = dict(kernel=variant.name, config=variant.label, dtype=variant.dtype, arch=arch)
    log = io.StringIO()
    start = time.perf_counter()
    knobs.nvidia.dump_ptxas_log = True  # ptxas's -v report is printed to stdout: the only place spills show
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(variant.kernel, signature, variant.constexprs, attrs),
                                      target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # noqa: BLE001 - every failure is a finding to report
        lines = [line for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
        return CompileReport(**base, shared=0, n_regs=0, n_spills=0, seconds=time.perf_counter() - start,
                             error=" | ".join(lines[:6]) or traceback.format_exc(limit=1))
    seconds = time.perf_counter() - start
    text = log.getvalue()
    spills, registers = _SPILLS.findall(text), _REGISTERS.findall(text)
    if not spills or not registers:
        return CompileReport(**base, shared=compiled.metadata.shared, n_regs=0, n_spills=0, seconds=seconds,
                             error=f"no ptxas report in the compile log: {text[-300:]!r}")
    return CompileReport(**base, shared=compiled.metadata.shared, n_regs=max(int(r) for r in registers),
                         n_spills=max(int(s) for s, _ in spills), seconds=seconds)


def _compile_task(task: tuple[int, int]) -> CompileReport:
    index, arch = task
    return compile_variant(all_variants()[index], arch)


def compile_all(archs: tuple[int, ...] = (80, 90), jobs: int = 2, kernel: str | None = None,
                tier: str = "full") -> list[CompileReport]:
    """Compile every variant (of `kernel` only, when given; of the default tier only, when tier is
    "default") for every target over `jobs` processes."""
    variants = all_variants()
    tasks = [(i, arch) for i, v in enumerate(variants)
             if kernel in (None, v.name) and (tier == "full" or v.tier == "default") for arch in archs]
    if jobs <= 1:
        return [_compile_task(t) for t in tasks]
    # NOTE: fork, so the workers inherit the imported kernels instead of pickling JIT functions.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("fork")) as pool:
        return list(pool.map(_compile_task, tasks, chunksize=4))


def format_table(reports: list[CompileReport]) -> str:
    columns = ["kernel", "config", "dtype", "target", "shared_B", "regs", "spills_B", "seconds", "problems"]
    rows = [[r.kernel, r.config, r.dtype, f"sm_{r.arch}", str(r.shared), str(r.n_regs), str(r.n_spills),
             f"{r.seconds:.2f}", "; ".join(r.problems) or "-"] for r in reports]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="compile processes (default 2)")
    ap.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated (default 80,90)")
    ap.add_argument("--kernel", help="compile only this kernel, e.g. _shrink_kernel")
    ap.add_argument("--tier", choices=("default", "full"), default="full",
                    help="full (default): every variant; default: what the default test suite compiles")
    ap.add_argument("--json", type=Path, help="also write the reports here")
    ap.add_argument("--quiet", action="store_true", help="print only the problems and the summary")
    args = ap.parse_args(argv)
    archs = tuple(int(a) for a in args.arch.split(","))
    with contextlib.ExitStack() as stack:
        cache = os.environ.get("TRITON_CACHE_DIR")
        if cache is None:
            cache = os.environ["TRITON_CACHE_DIR"] = stack.enter_context(tempfile.TemporaryDirectory())
        elif Path(cache).is_dir() and any(Path(cache).iterdir()):
            print(f"TRITON_CACHE_DIR={cache} is not empty: a cached kernel would hide its compile errors",
                  file=sys.stderr)
            return 2
        start = time.perf_counter()
        reports = compile_all(archs, args.jobs, args.kernel, args.tier)
        wall = time.perf_counter() - start
    bad = [r for r in reports if r.problems]
    if not args.quiet:
        print(format_table(reports))
    elif bad:
        print(format_table(bad))
    print(f"\n{len(reports)} compiles ({len(reports) - len(bad)} clean, {len(bad)} with problems) in {wall:.1f} s "
          f"over {args.jobs} processes")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"wall_s": wall, "jobs": args.jobs, "archs": list(archs), "tier": args.tier,
                                         "reports": [asdict(r) | {"problems": r.problems} for r in reports]},
                                        indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
