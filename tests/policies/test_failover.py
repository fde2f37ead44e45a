"""FailoverQuotaBackend with the real redis-server stopped mid-test: fail-open and fail-closed."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from urllib.parse import urlparse

import pytest
import redis

from policies.failover import FailoverConfig, FailoverQuotaBackend, FailureMode
from policies.quota import QuotaUnavailable, RefusalReason
from policies.redis_quota import RedisQuotaBackend
from policies.tenant_policy import TenantPolicy

pytestmark = pytest.mark.redis

POLICY = TenantPolicy(requests_per_minute=4, max_concurrent_requests=10)


def restart_redis_on_same_port(url: str, data_dir) -> subprocess.Popen:
    port = urlparse(url).port
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    client.close()
    return proc


def test_fail_open_uses_scaled_local_limits_then_recovers(redis_server, tmp_path, caplog):
    config = FailoverConfig(mode=FailureMode.FAIL_OPEN, retry_interval_s=0.0, local_limit_fraction=0.5)

    async def scenario(restarted: list[subprocess.Popen]) -> None:
        backend = FailoverQuotaBackend(RedisQuotaBackend.from_url(redis_server.url, timeout_s=0.5), config)
        shared = await backend.admit("t", POLICY, 1, 1)
        assert shared.granted and shared.lease.origin == "primary"
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="policies.failover"):
            local = [await backend.admit("t", POLICY, 1, 1) for _ in range(3)]
        assert [a.granted for a in local] == [True, True, False]  # 4 rpm * 0.5 on this replica
        assert local[0].lease.origin == "local"
        assert local[2].reason is RefusalReason.REQUESTS
        assert backend.degraded and backend.outages == 1 and backend.fallback_admissions == 3
        assert [r.levelname for r in caplog.records] == ["WARNING"], "one warning per outage"
        assert "failing open" in caplog.records[0].getMessage()
        assert await backend.reconcile(local[0].lease, 2)
        assert await backend.release(local[0].lease)
        assert not await backend.release(shared.lease)  # store down: dropped, counted, no exception
        assert backend.lost_updates == 1
        assert (await backend.usage("t")).in_flight == 1  # the local lease still held

        restarted.append(restart_redis_on_same_port(redis_server.url, tmp_path))
        again = await backend.admit("t", POLICY, 1, 1)
        assert again.granted and again.lease.origin == "primary"
        assert not backend.degraded
        await backend.close()

    restarted: list[subprocess.Popen] = []
    try:
        asyncio.run(scenario(restarted))
    finally:
        for proc in restarted:
            proc.terminate()
            proc.wait(timeout=10)


def test_fail_closed_raises_unavailable_and_skips_the_store_between_probes(redis_server, tmp_path):
    config = FailoverConfig(retry_interval_s=30.0, unavailable_retry_after_s=2.0)
    assert config.mode is FailureMode.FAIL_CLOSED, "fail-closed is the documented default"
    monotonic = [0.0]

    async def scenario(restarted: list[subprocess.Popen]) -> None:
        backend = FailoverQuotaBackend(RedisQuotaBackend.from_url(redis_server.url, timeout_s=0.5), config,
                                       monotonic=lambda: monotonic[0])
        lease = (await backend.admit("t", POLICY, 1, 1)).lease
        redis_server.stop()
        for _ in range(3):
            with pytest.raises(QuotaUnavailable, match="fail-closed") as refused:
                await backend.admit("t", POLICY, 1, 1)
            assert refused.value.retry_after_s == 2.0
        assert backend.refused_unavailable == 3 and backend.outages == 1
        with pytest.raises(QuotaUnavailable):
            await backend.usage("t")
        assert not await backend.release(lease)
        assert backend.lost_updates == 1
        restarted.append(restart_redis_on_same_port(redis_server.url, tmp_path))
        monotonic[0] = 29.0
        with pytest.raises(QuotaUnavailable):  # within retry_interval_s: the store is not even tried
            await backend.admit("t", POLICY, 1, 1)
        monotonic[0] = 31.0
        assert (await backend.admit("t", POLICY, 1, 1)).granted
        assert not backend.degraded
        await backend.close()

    restarted: list[subprocess.Popen] = []
    try:
        asyncio.run(scenario(restarted))
    finally:
        for proc in restarted:
            proc.terminate()
            proc.wait(timeout=10)


def test_failover_config_validation():
    with pytest.raises(ValueError, match="mode"):
        FailoverConfig(mode="open")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_limit_fraction"):
        FailoverConfig(local_limit_fraction=0)
