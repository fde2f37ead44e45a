"""Every Triton kernel variant the dispatch can launch compiles for sm_80 and sm_90, without a GPU.

`python -m kernels.triton_aot` runs in a subprocess: the kernels must be compiled, not interpreted
(conftest.py sets TRITON_INTERPRET for this process), and into a fresh Triton cache, because a kernel found
in a cache is not compiled again and its compile errors stay hidden. A variant fails on a compile error, on
any register spill, or on more shared memory than the target has. The set compiled is the dispatch's own
(`compile_variants()` of every kernels.*_triton module, over their exported config tables); this test
checks that it covers every kernel, and for attention and LoRA that it equals those tables. It compiles
the "default" tier (every launch config in every dtype for both targets; sliding-window attention variants
in bf16 only), 270 compiles over 2 processes: about two minutes on 2 shared cores. `python -m
kernels.triton_aot` (bench/gpu.sh too) compiles the full set, 352.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kernels import attention_triton, lora_triton  # noqa: E402
from kernels.launch_config import DATA_DTYPES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _compile_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # fresh: a cached kernel hides compile errors
    return env


def test_bundled_ptxas_runs_for_sm80_and_sm90() -> None:
    from triton.backends.nvidia.compiler import get_ptxas

    for arch in (80, 90):
        tool = get_ptxas(arch)
        out = subprocess.run([tool.path, "--version"], capture_output=True, text=True, timeout=60, check=True)
        assert "Cuda compilation tools" in out.stdout, out.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_dispatchable_variant_compiles_for_sm80_and_sm90(tmp_path: Path) -> None:
    report = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.triton_aot", "--jobs", "2", "--tier", "default", "--quiet", "--json",
         str(report)],
        cwd=REPO, env=_compile_env(tmp_path), capture_output=True, text=True, timeout=1100,
    )
    assert proc.returncode == 0, f"{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    data = json.loads(report.read_text())
    reports = data["reports"]
    assert all(not r["problems"] for r in reports)
    assert {r["arch"] for r in reports} == {80, 90}
    assert all(r["n_regs"] > 0 and r["n_spills"] == 0 for r in reports)

    assert {r["kernel"] for r in reports} == _jit_kernels()  # every kernel of every kernels.*_triton module
    compiled = {(r["kernel"], r["dtype"], r["config"].split(" | ")[0]) for r in reports
                if r["kernel"] in ("_decode_kernel", "_prefill_kernel", "_shrink_kernel", "_expand_kernel")}
    expected = set()
    for dtype in DATA_DTYPES:
        fp32 = dtype == "fp32"
        expected |= {("_decode_kernel", dtype, c.label) for c in attention_triton.DECODE_CONFIGS.values()}
        expected |= {("_prefill_kernel", dtype, c.label)
                     for (_, _, is_fp32), c in attention_triton.PREFILL_CONFIGS.items() if is_fp32 == fp32}
        expected |= {("_shrink_kernel", dtype, c.label)
                     for (_, _, is_fp32), c in lora_triton.SHRINK_CONFIGS.items() if is_fp32 == fp32}
        expected |= {("_expand_kernel", dtype, c.label)
                     for (_, is_fp32), c in lora_triton.EXPAND_CONFIGS.items() if is_fp32 == fp32}
    assert compiled == expected
    windows = {r["config"].split("USE_WINDOW=")[1][0] for r in reports if "USE_WINDOW=" in r["config"]}
    assert windows == {"0", "1"}  # attention compiles with and without a sliding window


def _jit_kernels() -> set[str]:
    """Names of the @triton.jit functions of every kernels.*_triton module (interpreted in this process)."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction

    from kernels.triton_aot import triton_modules

    names = set()
    for name in triton_modules():
        module = importlib.import_module(name)
        names |= {v.fn.__name__ for v in vars(module).values() if isinstance(v, InterpretedFunction)}
    return names


def test_compile_check_reports_a_compile_error(tmp_path: Path) -> None:
    """The check itself: a kernel reading a plain Python global (what broke attention) is a finding."""
    script = '''
import triton, triton.language as tl
from kernels import triton_aot
from kernels.launch_config import LaunchConfig, variant
LIMIT = 3.0
@triton.jit
def bad_kernel(x_ptr, BLOCK_N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK_N), tl.full([BLOCK_N], LIMIT, tl.float32))
report = triton_aot.compile_variant(variant(bad_kernel, "fp32", LaunchConfig.of(BLOCK_N=16), {}, ("x_ptr",)), 90)
print("PROBLEMS:", report.problems)
'''
    path = tmp_path / "bad_kernel.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], cwd=REPO, env=_compile_env(tmp_path) | {"PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "does not compile" in proc.stdout and "Cannot access global variable LIMIT" in proc.stdout, proc.stdout
