"""Worker discovery through Redis heartbeats (a real redis-server), and the CLI flags that wire it."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from demo.null_worker import NULL_CAPABILITIES, NullLLM
from gateway.cli.main import CommandError, build_parser
from gateway.cli.serve import external_worker_client
from gateway.workers.client import InProcessEngineClient
from gateway.workers.heartbeat import RedisWorkerDirectory, members_key, worker_key
from gateway.workers.registry import RegistryConfig, WorkerRegistry
from wire.protocol import WorkerState
from worker import cli as worker_cli
from worker.registration import HeartbeatConfig, WorkerHeartbeat
from worker.server import WorkerService

PREFIX = "test:workers"


def null_state() -> WorkerState:
    return WorkerService(NullLLM(), "null-model", NULL_CAPABILITIES).state()


def test_a_heartbeat_announces_the_worker_and_withdraws_it_on_stop(redis_server):
    config = HeartbeatConfig(redis_server.url, "http://10.0.0.7:8001/", interval_s=0.05, ttl_s=1.0,
                             key_prefix=PREFIX)

    async def scenario() -> None:
        directory = RedisWorkerDirectory(redis_server.url, PREFIX)
        task = asyncio.create_task(WorkerHeartbeat(config).run(null_state))
        for _ in range(100):
            if await directory.members():
                break
            await asyncio.sleep(0.02)
        members = await directory.members()
        assert list(members) == ["http://10.0.0.7:8001"]
        assert members["http://10.0.0.7:8001"].model == "null-model"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await directory.members() == {}  # withdrawn at once, not after the ttl
        await directory.close()

    asyncio.run(scenario())


def test_a_silent_worker_expires_and_is_pruned_from_the_member_set(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    url = "http://10.0.0.8:8001"
    client.set(worker_key(PREFIX, url), json.dumps({"url": url, "state": null_state().to_json()}), px=300)
    client.sadd(members_key(PREFIX), url)

    async def members() -> dict:
        directory = RedisWorkerDirectory(redis_server.url, PREFIX)
        try:
            return await directory.members()
        finally:
            await directory.close()

    assert list(asyncio.run(members())) == [url]
    for _ in range(100):
        if client.get(worker_key(PREFIX, url)) is None:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert asyncio.run(members()) == {}
    assert client.smembers(members_key(PREFIX)) == set()
    client.close()


def test_the_registry_adds_discovered_workers_and_drops_expired_ones(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    url = "http://10.0.0.9:8001"
    made: list[str] = []

    def client_for(worker_url: str):
        made.append(worker_url)
        return InProcessEngineClient(WorkerService(NullLLM(), "null-model", NULL_CAPABILITIES))

    async def scenario() -> None:
        registry = WorkerRegistry(client_for, directory=RedisWorkerDirectory(redis_server.url, PREFIX),
                                  config=RegistryConfig(poll_interval_s=60))
        removed: list[str] = []
        registry.add_removal_listener(removed.append)
        await registry.refresh()
        assert registry.all_workers() == []
        client.set(worker_key(PREFIX, url), json.dumps({"url": url, "state": null_state().to_json()}))
        client.sadd(members_key(PREFIX), url)
        await registry.refresh()
        assert [(w.worker_id, w.healthy, w.discovered) for w in registry.all_workers()] == [(url, True, True)]
        client.delete(worker_key(PREFIX, url))  # its heartbeat expired
        await registry.refresh()
        assert registry.all_workers() == [] and removed == [url]
        await registry.close()

    asyncio.run(scenario())
    assert made == [url]
    client.close()


@pytest.mark.parametrize("kwargs,message", [
    ({"redis_url": "localhost:6379"}, "redis://"),
    ({"advertise_url": "worker:8001"}, "advertise URL"),
    ({"interval_s": 2.0, "ttl_s": 1.0}, "must exceed its interval"),
])
def test_heartbeat_config_rejects_nonsense(kwargs, message):
    base = {"redis_url": "redis://127.0.0.1:6379/0", "advertise_url": "http://w:8001"}
    with pytest.raises(ValueError, match=message):
        HeartbeatConfig(**{**base, **kwargs})


@pytest.mark.parametrize("argv,message", [
    (["--advertise-url", "http://w:8001"], "only matters with --register-redis-url"),
    (["--register-redis-url", "redis://r:6379/0"], "needs --advertise-url"),
    (["--register-redis-url", "r:6379", "--advertise-url", "http://w:8001"], "redis://"),
])
def test_worker_registration_flags_are_checked(argv, message):
    with pytest.raises(worker_cli.WorkerCommandError, match=message):
        worker_cli.registration_heartbeat(worker_cli.build_parser({}).parse_args(argv))


def test_serve_routing_flags_are_checked(monkeypatch):
    monkeypatch.setenv("LORAPLEX_WORKER_SECRET", "s")
    args = build_parser({}).parse_args(["serve", "--discover-workers"])
    with pytest.raises(CommandError, match="needs --redis-url"):
        external_worker_client(args, lambda reason: None)
    args = build_parser({}).parse_args(["serve", "--worker-url", "http://a:1", "--worker-url", "a:2"])
    with pytest.raises(CommandError, match="--worker-url must be an http"):
        external_worker_client(args, lambda reason: None)
    env = {"LORAPLEX_ROUTING": "round_robin", "LORAPLEX_DISCOVER_WORKERS": "yes"}
    args = build_parser(env).parse_args(["serve", "--worker-url", "http://a:1", "--worker-url", "http://b:2"])
    assert (args.routing, args.discover_workers) == ("round_robin", "redis")
    with pytest.raises(SystemExit):
        build_parser({"LORAPLEX_DISCOVER_WORKERS": "maybe"})
