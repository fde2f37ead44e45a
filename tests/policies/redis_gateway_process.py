"""A stand-in gateway process for the multi-process Redis tests: its own interpreter, its own Redis client.

    python redis_gateway_process.py hammer URL NOW COUNT   -> prints "ready", waits for "go" on stdin, then
        admits COUNT requests for tenant "rpm" (30 req/min) and COUNT for "tpm" (3000 tok/min, 100 tokens
        each) spaced 10 ms apart and prints one JSON line {"rpm": granted, "tpm": granted, "t0": ..., "t1": ...}.
        NOW is unix seconds or "server" (Redis server time).
    python redis_gateway_process.py hold URL TTL COUNT     -> takes COUNT leases of tenant "conc" (limit 2),
        prints them as JSON, then renews them every TTL/4 seconds until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from policies.quota import Admission, QuotaConfig
from policies.redis_quota import RedisQuotaBackend
from policies.tenant_policy import TenantPolicy

RPM_POLICY = TenantPolicy(requests_per_minute=30, tokens_per_minute=1_000_000, max_concurrent_requests=1000)
TPM_POLICY = TenantPolicy(requests_per_minute=10_000, tokens_per_minute=3000, max_tokens_per_request=3000,
                          max_concurrent_requests=1000)
CONC_POLICY = TenantPolicy(max_concurrent_requests=2)
SPACING_S = 0.01


async def hammer(url: str, now_arg: str, count: int) -> None:
    backend = RedisQuotaBackend.from_url(url, timeout_s=5.0)
    now = None if now_arg == "server" else float(now_arg)
    await backend.usage("warmup")  # connect and load scripts before the barrier
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("expected 'go' on stdin")
    t0 = time.time()

    async def spaced(index: int, tenant: str, policy: TenantPolicy, prompt: int, completion: int) -> Admission:
        await asyncio.sleep(index * SPACING_S)  # spread over ~0.5 s so both processes interleave
        return await backend.admit(tenant, policy, prompt, completion, now)

    results = await asyncio.gather(
        *[spaced(i, "rpm", RPM_POLICY, 10, 10) for i in range(count)],
        *[spaced(i, "tpm", TPM_POLICY, 40, 60) for i in range(count)],
    )
    t1 = time.time()
    granted_rpm = sum(a.granted for a in results[:count])
    granted_tpm = sum(a.granted for a in results[count:])
    print(json.dumps({"rpm": granted_rpm, "tpm": granted_tpm, "t0": t0, "t1": t1}), flush=True)
    await backend.close()


async def hold(url: str, ttl: float, count: int) -> None:
    backend = RedisQuotaBackend.from_url(url, QuotaConfig(lease_ttl_s=ttl), timeout_s=5.0)
    leases = []
    for _ in range(count):
        admission = await backend.admit("conc", CONC_POLICY, 1, 1)
        if not admission.granted:
            raise SystemExit(f"could not take a lease: {admission.message}")
        leases.append(admission.lease)
    print(json.dumps([lease.lease_id for lease in leases]), flush=True)
    while True:
        await asyncio.sleep(ttl / 4)
        for lease in leases:
            await backend.renew(lease)


def main() -> None:
    command, url = sys.argv[1], sys.argv[2]
    if command == "hammer":
        asyncio.run(hammer(url, sys.argv[3], int(sys.argv[4])))
    elif command == "hold":
        asyncio.run(hold(url, float(sys.argv[3]), int(sys.argv[4])))
    else:
        raise SystemExit(f"unknown command {command!r}; expected 'hammer' or 'hold'")


if __name__ == "__main__":
    main()
