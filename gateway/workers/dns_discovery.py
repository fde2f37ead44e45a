"""Workers found in DNS: the address records of a Kubernetes headless Service (one per ready pod).

`loraplex serve --discover-workers dns://loraplex-workers.NAMESPACE.svc:8001` gives the registry a
`DnsWorkerDirectory`: every `interval_s` it resolves the name (getaddrinfo, in a thread: it blocks) and
answers `http://ADDRESS:PORT` for each address. A headless Service publishes only the pods that are ready,
so a worker pod enters the rotation once its readiness probe passes and leaves it when the pod stops
being ready or goes away; the registry's own state polls still decide health. No Redis is involved.

A name with no records at all (NXDOMAIN: the Service has no ready pod) is an empty directory. Any other
resolver failure raises, and the registry keeps the workers it has (as when Redis is unreachable).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from wire.protocol import WorkerState

log = logging.getLogger(__name__)

DNS_SCHEME = "dns"
# getaddrinfo's answers for "this name has no address": the only failures that mean "no workers".
_NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

Resolve = Callable[[str, int], Awaitable[Iterable[str]]]
"""`resolve(host, port)` → the host's addresses (IPv4 or IPv6 strings); [] when it has none."""


@dataclass(frozen=True)
class DnsDiscoveryConfig:
    host: str  # e.g. loraplex-workers.loraplex.svc (a headless Service)
    port: int  # the workers' port (their containerPort, not a Service port)
    interval_s: float = 5.0  # how often the name is resolved again
    resolve_timeout_s: float = 1.0  # how long one registry poll waits for a resolution in progress
    scheme: str = "http"  # of the worker URLs

    def __post_init__(self) -> None:
        if not self.host or "/" in self.host:
            raise ValueError(f"DNS discovery needs a host name, got {self.host!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"DNS discovery port must be 1..65535, got {self.port}")
        if self.interval_s <= 0 or self.resolve_timeout_s <= 0:
            raise ValueError("DNS discovery interval and resolve timeout must be > 0")
        if self.scheme not in ("http", "https"):
            raise ValueError(f"worker URLs are http or https, got {self.scheme!r}")

    @classmethod
    def from_url(cls, url: str, *, interval_s: float = 5.0, resolve_timeout_s: float = 1.0) -> DnsDiscoveryConfig:
        """`dns://HOST:PORT`, the form `--discover-workers` takes."""
        host, port = parse_dns_url(url)
        return cls(host=host, port=port, interval_s=interval_s, resolve_timeout_s=resolve_timeout_s)


def parse_dns_url(url: str) -> tuple[str, int]:
    """`dns://HOST:PORT` → (host, port). ValueError for anything else (a path, a query, no port)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if (parts.scheme != DNS_SCHEME or not parts.hostname or port is None or parts.path not in ("", "/")
            or parts.query or parts.fragment or parts.username or parts.password):
        raise ValueError(f"DNS discovery takes dns://HOST:PORT (e.g. dns://loraplex-workers.NAMESPACE.svc:8001), "
                         f"got {url!r}")
    return parts.hostname, port


async def resolve_with_getaddrinfo(host: str, port: int) -> list[str]:
    """The system resolver (search domains, /etc/hosts) run in the loop's thread pool, off the event loop."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in _NO_RECORDS:
            return []
        raise
    return [str(sockaddr[0]) for _family, _type, _proto, _name, sockaddr in infos]


def worker_url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address  # an IPv6 literal goes in brackets
    return f"{scheme}://{host}:{port}"


class DnsWorkerDirectory:
    """The workers behind one DNS name, re-resolved every `interval_s`; what `WorkerRegistry` polls.

    `members()` starts a resolution when the last one is `interval_s` old and waits for it at most
    `resolve_timeout_s`; until it ends, the previous answer stands (a slow resolver never holds up the
    registry's health polls for longer). At most one resolution runs at a time. A change in DNS reaches
    the rotation within `interval_s` plus one registry poll. Used from one event loop only.
    """

    def __init__(self, config: DnsDiscoveryConfig, resolve: Resolve | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._resolve = resolve or resolve_with_getaddrinfo
        self._clock = clock
        self._urls: list[str] | None = None  # None until the first resolution succeeded
        self._pending: asyncio.Task[list[str]] | None = None
        self._next_at = 0.0
        self._empty_logged = False

    async def members(self) -> dict[str, WorkerState | None]:
        """URL → None (DNS carries no state; the registry polls each worker). Raises what the resolver
        raised, or TimeoutError when the first resolution is not done within resolve_timeout_s."""
        if self._pending is None and self._clock() >= self._next_at:
            self._next_at = self._clock() + self.config.interval_s
            self._pending = asyncio.get_running_loop().create_task(self._lookup(), name="dns-worker-discovery")
        if self._pending is not None:
            done, _ = await asyncio.wait({self._pending}, timeout=self.config.resolve_timeout_s)
            if done:
                task, self._pending = self._pending, None
                self._urls = task.result()  # raises the resolver's error: the registry keeps its workers
            elif self._urls is None:
                raise TimeoutError(f"resolving {self.config.host} took longer than {self.config.resolve_timeout_s}s")
        return dict.fromkeys(self._urls or (), None)

    async def _lookup(self) -> list[str]:
        addresses = await self._resolve(self.config.host, self.config.port)
        urls = sorted({worker_url(self.config.scheme, a, self.config.port) for a in addresses})
        if not urls and not self._empty_logged:
            log.warning("DNS discovery: %s has no addresses (no ready worker pod yet, or a wrong name)",
                        self.config.host)
        self._empty_logged = not urls
        return urls

    async def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pending
            self._pending = None
