"""Quota backend fixtures: the contract suite (test_quota_backends.py) runs against every QuotaBackend."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from policies.memory_quota import MemoryQuotaBackend
from policies.quota import QuotaBackend, QuotaConfig
from policies.redis_quota import RedisQuotaBackend

Scenario = Callable[[QuotaBackend], Awaitable[None]]


class QuotaBackends:
    """Makes fresh backends of one kind; `run` gives a scenario one backend on its own event loop."""

    def __init__(self, kind: str, redis_url: str | None = None) -> None:
        self.kind = kind
        self.redis_url = redis_url

    def make(self, config: QuotaConfig | None = None) -> QuotaBackend:
        if self.redis_url is None:
            return MemoryQuotaBackend(config)
        return RedisQuotaBackend.from_url(self.redis_url, config)

    def run(self, scenario: Scenario, config: QuotaConfig | None = None) -> None:
        async def go() -> None:
            backend = self.make(config)
            try:
                await scenario(backend)
            finally:
                await backend.close()

        asyncio.run(go())


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def quota_backends(request: pytest.FixtureRequest) -> QuotaBackends:
    """Parametrized over MemoryQuotaBackend and RedisQuotaBackend on a real redis-server (fresh per test)."""
    if request.param == "memory":
        return QuotaBackends("memory")
    return QuotaBackends("redis", request.getfixturevalue("redis_server").url)
