"""Workers announce themselves in Redis; gateways read the announcements (worker discovery).

A worker started with `loraplex worker --register-redis-url URL --advertise-url http://host:port`
heartbeats (worker/registration.py, the write side): its state under `{prefix}:worker:{advertise url}`
with a time-to-live, and its URL in the set `{prefix}:members`. A worker that stops cleanly removes both;
one that dies is forgotten when its key expires. Gateways call `RedisWorkerDirectory.members()`.

NOTE: the key layout below must match worker/registration.py (gateway/ never imports worker/);
tests/gateway/test_routing_discovery.py runs the two against each other on a real Redis.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from wire.protocol import WorkerState

DEFAULT_KEY_PREFIX = "loraplex:workers"


def check_worker_url(url: str, what: str = "a worker URL") -> str:
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"{what} must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/")


def worker_key(prefix: str, url: str) -> str:
    return f"{prefix}:worker:{url}"


def members_key(prefix: str) -> str:
    return f"{prefix}:members"


class RedisWorkerDirectory:
    """The workers whose heartbeats are alive. Also prunes the member set of expired ones."""

    def __init__(self, redis_url: str, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        self.key_prefix = key_prefix
        self._client = aioredis.Redis.from_url(redis_url)

    async def members(self) -> dict[str, WorkerState | None]:
        """URL → the state in its last heartbeat (None if unreadable). Raises RedisError / OSError."""
        raw = await self._client.smembers(members_key(self.key_prefix))  # type: ignore[misc]
        urls = sorted(u.decode() if isinstance(u, bytes) else u for u in raw)
        if not urls:
            return {}
        payloads = await self._client.mget([worker_key(self.key_prefix, u) for u in urls])
        alive: dict[str, WorkerState | None] = {}
        expired = []
        for url, payload in zip(urls, payloads, strict=True):
            if payload is None:
                expired.append(url)
                continue
            try:
                alive[url] = WorkerState.from_json(json.loads(payload)["state"])
            except (ValueError, KeyError, TypeError):
                alive[url] = None
        if expired:
            await self._client.srem(members_key(self.key_prefix), *expired)
        return alive

    async def close(self) -> None:
        await self._client.aclose()
