"""Real processes for the scale-out tests: redis-server, engine workers (`loraplex worker` over a tiny
random model, registering in Redis by heartbeat) and gateways (`loraplex serve --discover-workers`)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.gateway.quota_stack import GatewayProcess, Process, start_redis, wait_http

SECRET = "scale-out-secret"
MODEL_NAME = "tiny"
SECRET_HEADERS = {"x-loraplex-worker-secret": SECRET}


@dataclass
class WorkerProcess:
    process: Process
    url: str

    def kill(self) -> None:
        self.process.stop(signal.SIGKILL)

    def stop(self) -> None:
        self.process.stop()


def start_worker(model_dir: Path, redis_url: str) -> WorkerProcess:
    """A real engine worker that heartbeats its URL into Redis (wait for it with wait_worker)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "gateway.cli.main", "worker", "--model", str(model_dir), "--served-model-name",
            MODEL_NAME, "--port", str(port), "--kv-cache-memory-gb", "0.05", "--max-num-seqs", "8",
            "--register-redis-url", redis_url, "--advertise-url", url]
    return WorkerProcess(Process(argv, env={"LORAPLEX_WORKER_SECRET": SECRET}), url)


def wait_worker(worker: WorkerProcess) -> None:
    wait_http(worker.url + "/health", worker.process, timeout_s=120, headers=SECRET_HEADERS)


def start_gateway(model_dir: Path, data_dir: Path, redis_url: str, routing: str) -> GatewayProcess:
    """`loraplex serve --discover-workers` over Redis (call .wait() before use)."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli.main", "serve", "--model", str(model_dir), "--served-model-name",
            MODEL_NAME, "--port", str(port), "--data-dir", str(data_dir), "--redis-url", redis_url,
            "--discover-workers", "--routing", routing, "--queue-capacity", "16"]
    return GatewayProcess(Process(argv, env={"LORAPLEX_WORKER_SECRET": SECRET}), f"http://127.0.0.1:{port}")


def wait_gateway_sees(gateway: GatewayProcess, workers: int, timeout_s: float = 30.0) -> None:
    """Until the gateway is healthy and has logged `workers` workers coming into rotation."""
    gateway.wait()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = gateway.process.lines
        if sum("is in rotation" in line for line in lines) >= workers:
            return
        time.sleep(0.1)
    raise AssertionError(f"gateway never saw {workers} workers:\n{gateway.process.tail()}")


@dataclass
class Stack:
    redis: Process
    redis_url: str
    workers: list[WorkerProcess]
    gateways: list[GatewayProcess] = field(default_factory=list)

    def stop(self) -> None:
        for g in self.gateways:
            g.stop()
        for w in self.workers:
            w.stop()
        self.redis.stop()


def start_stack(model_dir: Path, root: Path, num_workers: int = 2) -> Stack:
    redis_proc, redis_url = start_redis(root)
    workers = [start_worker(model_dir, redis_url) for _ in range(num_workers)]
    stack = Stack(redis_proc, redis_url, workers)
    try:
        for w in workers:
            wait_worker(w)
    except BaseException:
        stack.stop()
        raise
    return stack


def start_gateways(stack: Stack, model_dir: Path, root: Path, routing: str, count: int = 2) -> list[GatewayProcess]:
    gateways = [start_gateway(model_dir, root / f"{routing}-{i}", stack.redis_url, routing) for i in range(count)]
    stack.gateways.extend(gateways)
    for g in gateways:
        wait_gateway_sees(g, len(stack.workers))
    return gateways


def completion(prompt: list[int], max_tokens: int = 2, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


async def post_all(calls: list[tuple[str, str, dict]], concurrency: int, spacing_s: float = 0.0
                   ) -> list[httpx.Response]:
    """POST each (url, key, body) with at most `concurrency` in flight, call i not before i * spacing_s;
    answers in call order."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
        async def one(i: int, url: str, key: str, body: dict) -> httpx.Response:
            await asyncio.sleep(i * spacing_s)
            async with gate:
                return await client.post(url + "/v1/completions", json=body,
                                         headers={"authorization": f"Bearer {key}"})

        return await asyncio.gather(*[one(i, *call) for i, call in enumerate(calls)])
