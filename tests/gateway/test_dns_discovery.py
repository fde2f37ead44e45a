"""Worker discovery through DNS (a Kubernetes headless Service), with an injected resolver, and its CLI flags."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from demo.null_worker import NULL_CAPABILITIES, NullLLM
from gateway.cli.main import CommandError, build_parser
from gateway.cli.serve import external_worker_client, worker_directory
from gateway.workers.client import InProcessEngineClient
from gateway.workers.dns_discovery import (
    DnsDiscoveryConfig,
    DnsWorkerDirectory,
    parse_dns_url,
    resolve_with_getaddrinfo,
)
from gateway.workers.heartbeat import RedisWorkerDirectory
from gateway.workers.registry import RegistryConfig, WorkerRegistry
from worker.server import WorkerService

SERVICE = "loraplex-workers.loraplex.svc"


class TestResolver:
    """A headless Service's records, edited by the test; counts lookups."""

    __test__ = False  # not a pytest class

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.lookups: list[tuple[str, int]] = []
        self.error: Exception | None = None

    async def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append((host, port))
        if self.error is not None:
            raise self.error
        return list(self.addresses)


def null_client(url: str) -> InProcessEngineClient:
    return InProcessEngineClient(WorkerService(NullLLM(), "null-model", NULL_CAPABILITIES))


@pytest.mark.parametrize("url,expected", [
    ("dns://loraplex-workers.loraplex.svc:8001", ("loraplex-workers.loraplex.svc", 8001)),
    ("dns://Workers:9000/", ("workers", 9000)),
])
def test_dns_urls_parse(url, expected):
    assert parse_dns_url(url) == expected


@pytest.mark.parametrize("url", [
    "dns://loraplex-workers.loraplex.svc",  # no port
    "dns://w:0x1f", "dns://w:70000", "http://w:8001", "dns://:8001", "dns://w:8001/path", "dns://w:8001?x=1",
    "dns://user@w:8001",
])
def test_dns_urls_without_host_and_port_are_refused(url):
    with pytest.raises(ValueError, match="dns://HOST:PORT"):
        parse_dns_url(url)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError, match="interval"):
        DnsDiscoveryConfig(SERVICE, 8001, interval_s=0)
    with pytest.raises(ValueError, match="port"):
        DnsDiscoveryConfig(SERVICE, 0)


def test_addresses_become_sorted_worker_urls_and_are_resolved_once_per_interval():
    now = [100.0]
    resolver = TestResolver("10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::7")
    directory = DnsWorkerDirectory(DnsDiscoveryConfig(SERVICE, 8001, interval_s=5.0), resolver, clock=lambda: now[0])

    async def scenario() -> None:
        assert list(await directory.members()) == ["http://10.0.0.1:8001", "http://10.0.0.2:8001",
                                                   "http://[fd00::7]:8001"]
        resolver.addresses = ["10.0.0.3"]
        now[0] += 4.9
        assert len(await directory.members()) == 3 and len(resolver.lookups) == 1  # not due yet
        now[0] += 0.1
        assert list(await directory.members()) == ["http://10.0.0.3:8001"]
        assert resolver.lookups == [(SERVICE, 8001)] * 2
        await directory.close()

    asyncio.run(scenario())


def test_a_failed_lookup_raises_and_the_next_one_is_tried_after_the_interval():
    now = [0.0]
    resolver = TestResolver("10.0.0.1")
    directory = DnsWorkerDirectory(DnsDiscoveryConfig(SERVICE, 8001, interval_s=1.0), resolver, clock=lambda: now[0])

    async def scenario() -> None:
        assert list(await directory.members()) == ["http://10.0.0.1:8001"]
        resolver.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        now[0] += 1.0
        with pytest.raises(socket.gaierror):  # the registry logs it and keeps its workers
            await directory.members()
        assert list(await directory.members()) == ["http://10.0.0.1:8001"]  # the last answer stands
        resolver.error = None
        resolver.addresses = []
        now[0] += 1.0
        assert await directory.members() == {}
        await directory.close()

    asyncio.run(scenario())


def test_a_slow_resolver_holds_a_poll_up_for_the_timeout_only_and_never_runs_twice():
    now = [0.0]
    release = asyncio.Event()
    calls = []

    async def slow(host: str, port: int) -> list[str]:
        calls.append(host)
        if len(calls) > 1:
            await release.wait()
        return ["10.0.0.1"] if len(calls) == 1 else ["10.0.0.2"]

    config = DnsDiscoveryConfig(SERVICE, 8001, interval_s=1.0, resolve_timeout_s=0.05)
    directory = DnsWorkerDirectory(config, slow, clock=lambda: now[0])

    async def scenario() -> None:
        assert list(await directory.members()) == ["http://10.0.0.1:8001"]
        now[0] += 5.0
        started = time.monotonic()
        assert list(await directory.members()) == ["http://10.0.0.1:8001"]  # still resolving: last answer
        assert time.monotonic() - started < 1.0
        now[0] += 5.0
        assert list(await directory.members()) == ["http://10.0.0.1:8001"]
        assert len(calls) == 2  # the lookup in progress is waited for, not started again
        release.set()
        assert list(await directory.members()) == ["http://10.0.0.2:8001"]
        await directory.close()

    asyncio.run(scenario())


def test_the_system_resolver_runs_off_the_loop_and_no_records_means_no_workers(monkeypatch):
    async def scenario() -> None:
        assert "127.0.0.1" in await resolve_with_getaddrinfo("localhost", 8001)  # /etc/hosts, no network
        loop = asyncio.get_running_loop()

        async def nxdomain(*args, **kwargs):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

        monkeypatch.setattr(loop, "getaddrinfo", nxdomain)
        assert await resolve_with_getaddrinfo(SERVICE, 8001) == []

        async def servfail(*args, **kwargs):
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

        monkeypatch.setattr(loop, "getaddrinfo", servfail)
        with pytest.raises(socket.gaierror):
            await resolve_with_getaddrinfo(SERVICE, 8001)

    asyncio.run(scenario())


def test_workers_join_and_leave_the_rotation_within_the_interval():
    """The headless Service gains a ready pod, then loses one: the registry follows within one DNS
    interval plus one registry poll (plus scheduling slack on a loaded machine)."""
    interval, poll = 0.3, 0.05
    bound = interval + poll + 1.0
    resolver = TestResolver("10.0.0.1")
    made: list[str] = []

    def client_for(url: str) -> InProcessEngineClient:
        made.append(url)
        return null_client(url)

    directory = DnsWorkerDirectory(DnsDiscoveryConfig(SERVICE, 8001, interval_s=interval), resolver)
    registry = WorkerRegistry(client_for, directory=directory, config=RegistryConfig(poll_interval_s=poll))
    removed: list[str] = []
    registry.add_removal_listener(removed.append)

    def rotation() -> list[str]:
        return sorted(w.worker_id for w in registry.healthy_workers())

    async def until(predicate, bound_s: float) -> float:
        started = time.monotonic()
        while not predicate():
            assert time.monotonic() - started < bound_s, f"not within {bound_s}s: {rotation()}"
            await asyncio.sleep(0.01)
        return time.monotonic() - started

    async def scenario() -> None:
        async with registry.polling():
            assert rotation() == ["http://10.0.0.1:8001"]  # known before the first request
            resolver.addresses = ["10.0.0.1", "10.0.0.2"]
            await until(lambda: rotation() == ["http://10.0.0.1:8001", "http://10.0.0.2:8001"], bound)
            resolver.addresses = ["10.0.0.2"]
            await until(lambda: rotation() == ["http://10.0.0.2:8001"], bound)
            assert removed == ["http://10.0.0.1:8001"]
            assert [w.discovered for w in registry.all_workers()] == [True]
            resolver.error = OSError("DNS down")  # a failed lookup keeps the workers there are
            await asyncio.sleep(interval + 3 * poll)
            assert rotation() == ["http://10.0.0.2:8001"]
        await registry.close()

    asyncio.run(scenario())
    assert made == ["http://10.0.0.1:8001", "http://10.0.0.2:8001"]


def test_cli_discover_workers_takes_redis_or_a_dns_url(monkeypatch):
    parse = build_parser({}).parse_args
    assert parse(["serve"]).discover_workers is None
    assert parse(["serve", "--discover-workers"]).discover_workers == "redis"  # as before: Redis
    assert parse(["serve", "--discover-workers", "redis", "--port", "8000"]).discover_workers == "redis"
    args = parse(["serve", "--discover-workers", f"dns://{SERVICE}:8001", "--discovery-interval", "2.5"])
    assert (args.discover_workers, args.discovery_interval) == (f"dns://{SERVICE}:8001", 2.5)
    env = build_parser({"LORAPLEX_DISCOVER_WORKERS": f"dns://{SERVICE}:8001", "LORAPLEX_DISCOVERY_INTERVAL": "3"})
    assert (env.parse_args(["serve"]).discover_workers, env.parse_args(["serve"]).discovery_interval) == (
        f"dns://{SERVICE}:8001", 3.0)
    assert build_parser({"LORAPLEX_DISCOVER_WORKERS": "1"}).parse_args(["serve"]).discover_workers == "redis"
    for bad in (["serve", "--discover-workers", "dns://no-port"], ["serve", "--discover-workers", "consul"]):
        with pytest.raises(SystemExit):
            parse(bad)
    with pytest.raises(SystemExit):
        build_parser({"LORAPLEX_DISCOVER_WORKERS": "dns://no-port"})

    monkeypatch.setenv("LORAPLEX_WORKER_SECRET", "s")
    args = parse(["serve", "--discover-workers", f"dns://{SERVICE}:8001", "--discovery-interval", "2.5"])
    directory = worker_directory(args)  # no --redis-url needed
    assert isinstance(directory, DnsWorkerDirectory)
    assert (directory.config.host, directory.config.port, directory.config.interval_s) == (SERVICE, 8001, 2.5)
    router, resources = external_worker_client(args, lambda reason: None)
    assert router.registry.all_workers() == [] and resources is not None
    asyncio.run(router.close())
    redis_args = parse(["serve", "--discover-workers", "--redis-url", "redis://127.0.0.1:1/0"])
    redis_directory = worker_directory(redis_args)
    assert isinstance(redis_directory, RedisWorkerDirectory)
    asyncio.run(redis_directory.close())
    with pytest.raises(CommandError, match="needs --redis-url"):
        external_worker_client(parse(["serve", "--discover-workers"]), lambda reason: None)
    bad_interval = parse(["serve", "--discover-workers", f"dns://{SERVICE}:8001", "--discovery-interval", "0"])
    with pytest.raises(CommandError, match="interval"):
        external_worker_client(bad_interval, lambda reason: None)
