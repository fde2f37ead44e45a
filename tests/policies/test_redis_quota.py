"""RedisQuotaBackend's own behaviour on a real redis-server: exact limits across processes, the server
clock, leases of a killed gateway. The contract every QuotaBackend keeps is in test_quota_backends.py."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from policies.quota import QuotaConfig, RefusalReason
from policies.redis_quota import RedisQuotaBackend
from policies.tenant_policy import TenantPolicy

pytestmark = pytest.mark.redis

GATEWAY_PROCESS = Path(__file__).with_name("redis_gateway_process.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = 1_750_000_000.0


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(GATEWAY_PROCESS), *args], cwd=REPO_ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


def run_two_gateways(url: str, now_arg: str, per_process: int) -> list[dict]:
    procs = [spawn("hammer", url, now_arg, str(per_process)) for _ in range(2)]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:  # release both at once: their admits interleave in Redis
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(proc.stdout.readline()) for proc in procs]
        for proc in procs:
            assert proc.wait(timeout=20) == 0
        return results
    finally:
        for proc in procs:
            stop(proc)


def test_two_processes_admit_exactly_the_limit_at_fixed_time(redis_server):
    """90 requests (45 per process) at the same instant: exactly 30 of 30 rpm, exactly 30 x 100 of 3000 tpm."""
    results = run_two_gateways(redis_server.url, repr(T0), 45)
    assert sum(r["rpm"] for r in results) == 30
    assert sum(r["tpm"] for r in results) == 30
    assert all(r["rpm"] > 0 for r in results), "both gateways should have won some admissions"


def test_two_processes_on_redis_server_time(redis_server):
    """Same with the server clock: accepted = 30 + whatever refilled (0.5/s) while the burst ran."""
    results = run_two_gateways(redis_server.url, "server", 45)
    burst_s = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    refill = math.floor(burst_s * 30 / 60)
    for limited in ("rpm", "tpm"):
        accepted = sum(r[limited] for r in results)
        assert 30 <= accepted <= 30 + refill, (limited, accepted, burst_s)


def test_concurrency_limit_holds_under_20_parallel_streams_on_two_clients(redis_server):
    policy = TenantPolicy(max_concurrent_requests=2, requests_per_minute=100_000)

    async def scenario() -> tuple[int, int, int]:
        gateways = [RedisQuotaBackend.from_url(redis_server.url) for _ in range(2)]
        holding = 0
        peak = 0
        completed = 0

        async def stream(index: int) -> None:
            nonlocal holding, peak, completed
            backend = gateways[index % 2]
            for _ in range(3):
                while True:
                    admission = await backend.admit("t", policy, 5, 5)
                    if admission.granted:
                        break
                    assert admission.reason is RefusalReason.CONCURRENCY
                    await asyncio.sleep(0.002)
                holding += 1
                peak = max(peak, holding)
                usage = await backend.usage("t")
                assert usage.in_flight <= 2
                await asyncio.sleep(0.005)
                holding -= 1
                await backend.reconcile(admission.lease, 7)
                assert await backend.release(admission.lease)
                completed += 1

        await asyncio.gather(*[stream(i) for i in range(20)])
        final = await gateways[0].usage("t")
        for gateway in gateways:
            await gateway.close()
        return peak, completed, final.in_flight

    peak, completed, in_flight = asyncio.run(scenario())
    assert peak == 2
    assert completed == 60
    assert in_flight == 0


def _redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_killed_gateway_frees_its_leases_within_the_ttl(redis_server):
    """Judged by the leases' own expiries (zset scores, on the Redis clock the scripts use), not by the
    test's timing, which a loaded machine stretches."""
    ttl = 2.0  # the holder renews every ttl / 4: only a 1.5 s stall lets a live lease lapse
    leases_key = f"{QuotaConfig().key_prefix}:{{conc}}:leases"
    policy = TenantPolicy(max_concurrent_requests=2)
    holder = spawn("hold", redis_server.url, repr(ttl), "2")
    r = redis.Redis.from_url(redis_server.url)

    def expiries() -> dict[bytes, float]:
        return dict(r.zrange(leases_key, 0, -1, withscores=True))

    try:
        ids = json.loads(holder.stdout.readline())
        assert len(ids) == 2
        taken = expiries()
        assert sorted(taken) == sorted(i.encode() for i in ids)

        async def scenario() -> None:
            backend = RedisQuotaBackend.from_url(redis_server.url, QuotaConfig(lease_ttl_s=ttl))
            # The live holder renews: both leases outlive the ttl they were taken with.
            deadline = time.monotonic() + 30
            while not (_redis_now(r) > max(taken.values())
                       and all(expiries().get(k, 0.0) > taken[k] for k in taken)):
                assert time.monotonic() < deadline, ("never renewed", taken, expiries())
                await asyncio.sleep(0.02)
            live = expiries()
            refused = await backend.admit("conc", policy, 1, 1)
            if min(live.values()) > _redis_now(r):  # both were live through the admit
                assert not refused.granted and refused.reason is RefusalReason.CONCURRENCY
            elif refused.granted:  # one lapsed around the admit (a starved holder): it may be taken
                await backend.release(refused.lease)
            holder.kill()
            holder.wait()
            killed_at, dead = _redis_now(r), expiries()
            assert max(dead.values()) <= killed_at + ttl
            while True:
                asked = _redis_now(r)
                admission = await backend.admit("conc", policy, 1, 1)
                if admission.granted:
                    # granted only once a lease had expired, and nothing renews a dead holder's leases
                    assert _redis_now(r) >= min(dead.values())
                    break
                assert admission.reason is RefusalReason.CONCURRENCY
                live = expiries()
                assert asked < min(live.values()) <= killed_at + ttl, (asked, live, killed_at)
                await asyncio.sleep(0.02)
            await backend.close()

        asyncio.run(scenario())
    finally:
        stop(holder)
        r.close()
