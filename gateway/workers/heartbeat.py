"""Workers announce themselves in Redis; gateways read the announcements (worker discovery).

A worker started with `loraplex worker --register-redis-url URL --advertise-url http://host:port` runs a
`WorkerHeartbeat` in its event loop: every `interval_s` it writes its state under
`{prefix}:worker:{advertise url}` with a time-to-live of `ttl_s` and adds the URL to the set
`{prefix}:members`. A worker that stops cleanly removes both; one that dies is forgotten when its key
expires (no clocks are compared: Redis expires the key). Gateways call `RedisWorkerDirectory.members()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from wire.protocol import WorkerState

log = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "loraplex:workers"


@dataclass(frozen=True)
class HeartbeatConfig:
    redis_url: str
    advertise_url: str  # how gateways reach this worker (http://host:port)
    interval_s: float = 1.0
    ttl_s: float = 5.0  # gateways forget a worker this long after its last heartbeat
    key_prefix: str = DEFAULT_KEY_PREFIX

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"the registration Redis URL must start with redis://, rediss:// or unix://, "
                             f"got {self.redis_url!r}")
        check_worker_url(self.advertise_url, "the advertise URL")
        if self.interval_s <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {self.interval_s}")
        if self.ttl_s <= self.interval_s:
            raise ValueError(f"heartbeat ttl ({self.ttl_s}) must exceed its interval ({self.interval_s})")


def check_worker_url(url: str, what: str = "a worker URL") -> str:
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"{what} must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/")


def worker_key(prefix: str, url: str) -> str:
    return f"{prefix}:worker:{url}"


def members_key(prefix: str) -> str:
    return f"{prefix}:members"


class WorkerHeartbeat:
    """Publishes one worker's URL and state until cancelled (then withdraws it)."""

    def __init__(self, config: HeartbeatConfig) -> None:
        self.config = config
        self.url = check_worker_url(config.advertise_url)

    async def run(self, state: Callable[[], WorkerState]) -> None:
        """Heartbeat forever; Redis errors are logged and retried at the next beat."""
        client = aioredis.Redis.from_url(self.config.redis_url)
        prefix, ttl_ms = self.config.key_prefix, int(self.config.ttl_s * 1000)
        try:
            while True:
                payload = json.dumps({"url": self.url, "state": state().to_json()})
                try:
                    async with client.pipeline(transaction=True) as pipe:
                        pipe.set(worker_key(prefix, self.url), payload, px=ttl_ms)
                        pipe.sadd(members_key(prefix), self.url)
                        await pipe.execute()
                except (RedisError, OSError) as e:
                    log.warning("worker heartbeat to Redis failed: %s", e)
                await asyncio.sleep(self.config.interval_s)
        finally:
            with contextlib.suppress(RedisError, OSError, asyncio.CancelledError):
                await asyncio.shield(self._withdraw(client))
            await client.aclose()

    async def _withdraw(self, client: aioredis.Redis) -> None:
        prefix = self.config.key_prefix
        async with client.pipeline(transaction=True) as pipe:
            pipe.delete(worker_key(prefix, self.url))
            pipe.srem(members_key(prefix), self.url)
            await pipe.execute()


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
