"""A worker announcing itself to the gateways: heartbeats of its URL and state into Redis.

Started with `--register-redis-url URL --advertise-url http://host:port`, the worker runs a
`WorkerHeartbeat` in its event loop: every `interval_s` it writes `{"url": ..., "state": WorkerState}` under
`{prefix}:worker:{advertise url}` with a time-to-live of `ttl_s` and adds the URL to the set
`{prefix}:members`. A worker that stops cleanly removes both; one that dies is forgotten when its key
expires (no clocks are compared: Redis expires the key).

NOTE: this is the write side; gateway/workers/heartbeat.py reads the same keys (the two never import each
other: worker/ and gateway/ meet only in wire/). tests/gateway/test_routing_discovery.py runs one against
the other on a real Redis, so a change to the key layout on one side fails there.
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


def worker_key(prefix: str, url: str) -> str:
    return f"{prefix}:worker:{url}"


def members_key(prefix: str) -> str:
    return f"{prefix}:members"


def advertised_url(url: str) -> str:
    """`url` without a trailing slash; ValueError unless it is an http(s) URL with a host."""
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"the advertise URL must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/")


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
        advertised_url(self.advertise_url)
        if self.interval_s <= 0:
            raise ValueError(f"heartbeat interval must be > 0, got {self.interval_s}")
        if self.ttl_s <= self.interval_s:
            raise ValueError(f"heartbeat ttl ({self.ttl_s}) must exceed its interval ({self.interval_s})")


class WorkerHeartbeat:
    """Publishes one worker's URL and state until cancelled (then withdraws it)."""

    def __init__(self, config: HeartbeatConfig) -> None:
        self.config = config
        self.url = advertised_url(config.advertise_url)

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
