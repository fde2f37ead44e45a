"""A bystander tenant's latency with and without a flooding tenant on the same gateway and worker.

Processes: `loraplex serve --model <bench model>` (the gateway and its supervised local worker, SQLite
store) and this client. The bystander sends streamed greedy completions of `MAX_TOKENS` tokens, one
after another (closed loop), from a fixed seeded prompt; latency is send to last byte. Quiet blocks and
flooded blocks alternate (rounds), so load from outside the benchmark falls on both alike. In a flooded
block another process, the flooder (another tenant, with a tight policy), runs four attacks at once:

- large prompts: chat bodies just under the gateway's body limit (`FILL` of it), two in flight;
- schemas: json_schema response formats nested `SCHEMA_DEPTH` deep, and wide ones (`WIDE_PROPERTIES`
  properties), two in flight;
- slow uploads: `SLOW_UPLOADS` adapter uploads at once, each trickling `TRICKLE_BYTES` every
  `TRICKLE_INTERVAL_S` (a new one starts when the gateway ends one);
- bursts: `BURST` small requests at once every second, far above its rate limit.

Goal: the bystander's p99 within 2x of the quiet blocks', and its output the same in every request.

    python -m bench.isolation [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.common import bench_model, percentile, print_table, write_json
from bench.gateway_overhead import free_port, spawn, stop, wait_ok

MODEL_NAME = "bench"
MAX_TOKENS = 16
PROMPT_TOKENS = 32
MAX_BODY_BYTES = 4 * 1024 * 1024  # `serve`'s default (gateway/state.py DEFAULT_MAX_BODY_BYTES)
FILL = 0.95
SCHEMA_DEPTH = 900
WIDE_PROPERTIES = 20_000
SLOW_UPLOADS = 8
TRICKLE_BYTES = 512
TRICKLE_INTERVAL_S = 0.5
BURST = 50
FLOOD_WARMUP_S = 2.0
ROOMY = {"requests_per_minute": 100_000, "tokens_per_minute": 100_000_000, "max_concurrent_requests": 64,
         "max_queued_requests": 256}
FLOODER = {"requests_per_minute": 60, "tokens_per_minute": 200_000, "max_concurrent_requests": 4,
           "max_queued_requests": 8}


def bystander_prompt(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(PROMPT_TOKENS)]


async def bystander_run(client: httpx.AsyncClient, url: str, key: str, n: int) -> tuple[list[float], list[str]]:
    """n sequential streamed completions: (latencies in s, texts)."""
    body = {"model": MODEL_NAME, "prompt": bystander_prompt(), "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    latencies, texts = [], []
    for _ in range(n):
        began = time.perf_counter()
        text = ""
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers={"authorization": f"Bearer {key}"}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
        latencies.append(time.perf_counter() - began)
        texts.append(text)
    return latencies, texts


def deep_schema_json(depth: int) -> str:
    """JSON text of an object schema nested `depth` deep (json.dumps would overflow the stack)."""
    return ('{"type":"object","properties":{"a":' * depth + '{"type":"string"}'
            + '},"required":["a"]}' * depth)


def chat_with_schema(schema_json: str) -> bytes:
    head = json.dumps({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "json please"}]})
    return (head[:-1] + ', "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
            + schema_json + "}}}").encode()


class Flooder:
    """The four attacks, each a loop until `stop` is set; `statuses` counts the gateway's answers by kind."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.headers = {"authorization": f"Bearer {key}"}
        self.statuses: dict[str, Counter] = {k: Counter() for k in ("large_prompt", "schema", "slow_upload", "burst")}
        self.stop = asyncio.Event()
        filler = "lorem ipsum dolor sit amet " * (int(MAX_BODY_BYTES * FILL) // 27)
        self.large_body = json.dumps({"model": MODEL_NAME, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": filler}]}).encode()
        wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(WIDE_PROPERTIES)}}
        self.schema_bodies = [chat_with_schema(deep_schema_json(SCHEMA_DEPTH)), chat_with_schema(json.dumps(wide))]

    async def _post(self, client: httpx.AsyncClient, kind: str, path: str, content: bytes) -> None:
        try:
            resp = await client.post(self.url + path, content=content,
                                     headers={**self.headers, "content-type": "application/json"})
            self.statuses[kind][resp.status_code] += 1
        except httpx.HTTPError as e:
            self.statuses[kind][type(e).__name__] += 1

    async def _loop(self, work) -> None:
        while not self.stop.is_set():
            await work()

    async def run(self, client: httpx.AsyncClient) -> None:
        async def large() -> None:
            await self._post(client, "large_prompt", "/v1/chat/completions", self.large_body)

        schemas = iter(range(10**9))

        async def schema() -> None:
            body = self.schema_bodies[next(schemas) % len(self.schema_bodies)]
            await self._post(client, "schema", "/v1/chat/completions", body)

        async def burst() -> None:
            small = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}).encode()
            await asyncio.gather(*(self._post(client, "burst", "/v1/completions", small) for _ in range(BURST)))
            await asyncio.sleep(1.0)

        loops = [large, large, schema, schema, burst] + [self._slow_upload] * SLOW_UPLOADS
        await asyncio.gather(*(self._loop(w) for w in loops))

    async def _slow_upload(self) -> None:
        boundary = "benchisolation"
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nslow\r\n--{boundary}\r\n'
                f'Content-Disposition: form-data; name="file"; filename="a.tar.gz"\r\n'
                f"Content-Type: application/gzip\r\n\r\n").encode()

        async def trickle():
            yield head
            while not self.stop.is_set():
                await asyncio.sleep(TRICKLE_INTERVAL_S)
                yield b"\0" * TRICKLE_BYTES

        headers = {**self.headers, "content-type": f"multipart/form-data; boundary={boundary}"}
        try:
            # its own client: a trickling body holds one connection, and the pool is the others'
            async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
                resp = await client.post(self.url + "/v1/adapters", content=trickle(), headers=headers)
            self.statuses["slow_upload"][resp.status_code] += 1
        except httpx.HTTPError as e:
            self.statuses["slow_upload"][type(e).__name__] += 1
            await asyncio.sleep(0.1)


async def flood_until_stdin_closes(url: str, key: str) -> dict:
    """The flooder process: attack until its stdin closes, then report its answers."""
    flooder = Flooder(url, key)
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=BURST + 8)) as client:
        attack = asyncio.create_task(flooder.run(client))
        await loop.run_in_executor(None, sys.stdin.read)
        flooder.stop.set()
        try:
            await asyncio.wait_for(attack, timeout=60)
        except TimeoutError:
            attack.cancel()
    return {kind: {str(k): v for k, v in c.items()} for kind, c in flooder.statuses.items()}


@contextlib.contextmanager
def flooding(url: str, key: str, totals: dict[str, Counter]):
    """A flooder process for the block; its answers are added to `totals`."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.isolation", "--flood", url, key], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1])
    try:
        time.sleep(FLOOD_WARMUP_S)  # every attack under way before the bystander measures
        yield
    finally:
        out, _ = proc.communicate(timeout=120)
    for kind, counts in json.loads(out).items():
        totals.setdefault(kind, Counter()).update(counts)


def bystander_rounds(url: str, key: str, flooder_key: str, rounds: int, per_round: int,
                     totals: dict[str, Counter]) -> tuple[list[float], list[float], set[str]]:
    """Quiet and flooded blocks, alternated (so load from outside the benchmark falls on both alike)."""
    quiet: list[float] = []
    flooded: list[float] = []
    texts: set[str] = set()

    async def measure(into: list[float], n: int) -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            latencies, got = await bystander_run(client, url, key, n)
        into.extend(latencies)
        texts.update(got)

    asyncio.run(measure([], 3))  # warm-up
    for r in range(rounds):
        asyncio.run(measure(quiet, per_round))
        with flooding(url, flooder_key, totals):
            asyncio.run(measure(flooded, per_round))
        print(f"round {r + 1}/{rounds}: quiet p50 {percentile(quiet, 50):.2f} s, flooded p50 "
              f"{percentile(flooded, 50):.2f} s", flush=True)
    return quiet, flooded, texts


def row(phase: str, latencies: list[float], quiet_p99: float | None = None) -> dict:
    p99 = percentile(latencies, 99) * 1000
    return {"phase": phase, "requests": len(latencies), "p50_ms": percentile(latencies, 50) * 1000, "p99_ms": p99,
            "max_ms": max(latencies) * 1000, "p99_vs_quiet": None if quiet_p99 is None else p99 / quiet_p99}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds of 5 bystander requests per phase, not 6 of 10")
    parser.add_argument("--flood", nargs=2, metavar=("URL", "KEY"), help=argparse.SUPPRESS)  # the flooder process
    args = parser.parse_args(argv)
    if args.flood:
        print(json.dumps(asyncio.run(flood_until_stdin_closes(*args.flood))))
        return 0
    rounds, per_round = (4, 5) if args.quick else (6, 10)
    model = bench_model()
    root = Path(tempfile.mkdtemp(prefix="isolation-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = spawn([sys.executable, "-m", "gateway.cli.main", "serve", "--model", str(model), "--served-model-name",
                     MODEL_NAME, "--port", str(port), "--data-dir", str(root)])
    totals: dict[str, Counter] = {}
    try:
        wait_ok(url + "/health", timeout_s=180)
        from gateway.store import open_store

        with open_store(root / "store.db") as store:
            keys = {name: store.create_api_key(store.create_tenant(name, policy=policy).id)[0]
                    for name, policy in (("bystander", ROOMY), ("flooder", FLOODER))}
        quiet, flooded, texts = bystander_rounds(url, keys["bystander"], keys["flooder"], rounds, per_round, totals)
    finally:
        stop(gateway)
    quiet_row = row("quiet", quiet)
    rows = [quiet_row, row("flooded", flooded, quiet_row["p99_ms"])]
    print_table(f"bystander streamed completions of {MAX_TOKENS} tokens, sequential, {rounds} alternated rounds "
                "(goal: flooded p99 <= 2x quiet)", rows, ["phase", "requests", "p50_ms", "p99_ms", "max_ms",
                                                         "p99_vs_quiet"])
    attacks = [{"attack": kind, "answers": sum(c.values()), **dict(c)} for kind, c in totals.items()]
    codes = sorted({k for a in attacks for k in a if k not in ("attack", "answers")})
    print_table("the flooder's answers (status or client-side error)", attacks, ["attack", "answers", *codes])
    same = len(texts) == 1
    print(f"\nbystander output identical in every request of both phases: {same}")
    write_json("isolation", {"quick": args.quick, "max_tokens": MAX_TOKENS, "prompt_tokens": PROMPT_TOKENS,
                             "rounds": rounds, "per_round": per_round, "rows": rows, "flooder": attacks,
                             "same_tokens": same,
                             "attacks": {"fill": FILL, "schema_depth": SCHEMA_DEPTH, "wide_properties": WIDE_PROPERTIES,
                                         "slow_uploads": SLOW_UPLOADS, "trickle_bytes": TRICKLE_BYTES,
                                         "trickle_interval_s": TRICKLE_INTERVAL_S, "burst": BURST}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
