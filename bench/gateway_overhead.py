"""Latency the gateway adds (auth, quota, fair queue, routing, SSE) over calling a null worker directly.

Processes: a null engine worker (demo.null_worker: answers at once), `loraplex serve
--worker-url` with the SQLite store (memory quotas) and with Redis (store and quotas), and this client.
Rows "sqlite+budget" use a tenant with a daily token budget on the SQLite gateway, so every request's
bookings are committed (fsynced, group-committed) to <data-dir>/quota_ledger.db before it is admitted.
At each target rate an open-loop client (bounded to --max-in-flight requests) sends streamed completions
of `MAX_TOKENS` tokens, first straight to the worker's /generate, then through the gateway; latency is send
to last byte. Overhead = gateway percentile - direct percentile.

    python -m bench.gateway_overhead [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import CACHE, percentile, print_table, write_json
from demo.checkpoint import FAMILIES, make_checkpoint, train_tokenizer

SECRET = "bench-secret"
MODEL_NAME = "null-model"
MAX_TOKENS = 8
PROMPT = list(range(1, 17))
ROOMY = {"requests_per_minute": 10_000_000, "tokens_per_minute": 100_000_000, "max_concurrent_requests": 100_000,
         "max_queued_requests": 100_000, "max_tokens_per_request": 100_000}
BUDGETED = {**ROOMY, "daily_token_budget": 10**12}  # never refuses, but every booking must be durable


def tokenizer_model() -> Path:
    """A tiny model directory; the gateway only reads its tokenizer and config."""
    target = CACHE / "gateway-overhead-model"
    if not (target / "config.json").is_file():
        tok = train_tokenizer(CACHE / "gateway-overhead-tokenizer", "byte_bpe")
        make_checkpoint(target, FAMILIES["llama"], tokenizer_dir=tok)
    return target


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "LORAPLEX_WORKER_SECRET": SECRET, **(env or {})},
                            cwd=Path(__file__).resolve().parents[1])


def wait_ok(url: str, headers: dict | None = None, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def run_load(send, rate: float, duration_s: float, max_in_flight: int) -> dict:
    """Open loop at `rate` req/s for `duration_s`; at most max_in_flight at once (later sends wait)."""
    latencies: list[float] = []
    errors = 0
    gate = asyncio.Semaphore(max_in_flight)

    async def one() -> None:
        nonlocal errors
        async with gate:
            began = time.perf_counter()
            try:
                await send()
            except Exception:
                errors += 1
                return
            latencies.append(time.perf_counter() - began)

    tasks = []
    start = time.perf_counter()
    total = int(rate * duration_s)
    for i in range(total):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    return {"sent": total, "ok": len(latencies), "errors": errors, "achieved_rps": len(latencies) / elapsed,
            "p50_ms": percentile(latencies, 50) * 1000, "p99_ms": percentile(latencies, 99) * 1000}


def direct_sender(client: httpx.AsyncClient, worker_url: str):
    counter = iter(range(10**9))

    async def send() -> None:
        body = {"request_id": f"direct-{next(counter)}", "prompt_token_ids": PROMPT,
                "sampling": {"max_tokens": MAX_TOKENS}}
        async with client.stream("POST", worker_url + "/generate", json=body,
                                 headers={"x-loraplex-worker-secret": SECRET}) as resp:
            resp.raise_for_status()
            async for _ in resp.aiter_bytes():
                pass
    return send


def gateway_sender(client: httpx.AsyncClient, gateway_url: str, key: str):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}

    async def send() -> None:
        async with client.stream("POST", gateway_url + "/v1/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as resp:
            resp.raise_for_status()
            async for _ in resp.aiter_bytes():
                pass
    return send


async def measure(send, rate: float, duration_s: float, max_in_flight: int) -> dict:
    await run_load(send, min(rate, 100), 1.0, max_in_flight)  # warm-up: connections, caches
    return await run_load(send, rate, duration_s, max_in_flight)


def start_gateway(model: Path, data_dir: Path, worker_url: str, redis_url: str | None
                  ) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """The gateway process, its URL, and an API key per tenant kind ("roomy", "budgeted")."""
    from gateway.store import open_store

    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli.main", "serve", "--model", str(model), "--served-model-name", MODEL_NAME,
            "--worker-url", worker_url, "--port", str(port), "--data-dir", str(data_dir), "--queue-capacity", "1024"]
    if redis_url:
        argv += ["--redis-url", redis_url]
    proc = spawn(argv)
    url = f"http://127.0.0.1:{port}"
    wait_ok(url + "/health")
    store = open_store(redis_url) if redis_url else open_store(data_dir / "store.db")
    keys = {}
    for kind, policy in (("roomy", ROOMY), ("budgeted", BUDGETED)):
        tenant = store.create_tenant(f"bench-{kind}-{port}", policy=policy)
        keys[kind] = store.create_api_key(tenant.id)[0]
    store.close()
    return proc, url, keys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 s per point instead of 8 s")
    parser.add_argument("--rates", default="200,1000")
    parser.add_argument("--max-in-flight", type=int, default=64)
    args = parser.parse_args(argv)
    duration = 2.0 if args.quick else 8.0
    rates = [float(r) for r in args.rates.split(",")]
    model = tokenizer_model()
    root = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    worker_port, redis_port = free_port(), free_port()
    worker_url, redis_url = f"http://127.0.0.1:{worker_port}", f"redis://127.0.0.1:{redis_port}/0"
    procs = [spawn([sys.executable, "-m", "demo.null_worker", "--port", str(worker_port)]),
             spawn(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(root)])]
    rows = []
    try:
        wait_ok(worker_url + "/health", {"x-loraplex-worker-secret": SECRET})
        gateways = {}
        for store_kind, url in (("sqlite", None), ("redis", redis_url)):
            proc, gw_url, keys = start_gateway(model, root / store_kind, worker_url, url)
            procs.append(proc)
            gateways[store_kind] = (gw_url, keys["roomy"])
            if store_kind == "sqlite":
                gateways["sqlite+budget"] = (gw_url, keys["budgeted"])

        async def run_all() -> None:
            limits = httpx.Limits(max_connections=args.max_in_flight, max_keepalive_connections=args.max_in_flight)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                for rate in rates:
                    direct = await measure(direct_sender(client, worker_url), rate, duration, args.max_in_flight)
                    rows.append({"path": "direct", "store": "-", "rate": rate, **direct})
                    for store_kind, (gw_url, key) in gateways.items():
                        via = await measure(gateway_sender(client, gw_url, key), rate, duration, args.max_in_flight)
                        rows.append({"path": "gateway", "store": store_kind, "rate": rate, **via,
                                     "overhead_p50_ms": via["p50_ms"] - direct["p50_ms"],
                                     "overhead_p99_ms": via["p99_ms"] - direct["p99_ms"]})

        asyncio.run(run_all())
    finally:
        for proc in reversed(procs):
            stop(proc)
    columns = ["path", "store", "rate", "achieved_rps", "ok", "errors", "p50_ms", "p99_ms", "overhead_p50_ms",
               "overhead_p99_ms"]
    print_table(f"gateway overhead, streamed completions of {MAX_TOKENS} tokens (target at 200 req/s: "
                "overhead p50 <= 2 ms, p99 <= 10 ms; LiteLLM publishes a 2-12 ms median)", rows, columns)
    write_json("gateway_overhead", {"max_tokens": MAX_TOKENS, "prompt_tokens": len(PROMPT),
                                    "duration_s": duration, "max_in_flight": args.max_in_flight, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
