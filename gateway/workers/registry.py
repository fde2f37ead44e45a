"""The engine workers one gateway can route to, and whether each is healthy right now.

Workers come from configuration (`--worker-url`, repeatable) and/or from a directory: heartbeats in Redis
(gateway/workers/heartbeat.py) or a headless Service's DNS records (gateway/workers/dns_discovery.py). A
poll every `poll_interval_s` reads each worker's `/state` (that is the health check: it proves the worker
answers with the secret) and, with discovery, the directory. A worker whose state poll fails
`unhealthy_after` times in a row, or that refuses a connection while a request is being routed
(`mark_unreachable`), leaves the rotation; its next successful poll brings it back. A discovered worker that
left the directory (heartbeat expired, DNS record gone) is removed. Requests already running on a worker
that dies end on their own: their streams break (RequestError engine_error in the HTTP client).

Load of a worker = requests this gateway has running there now + what the worker reported beyond the
requests this gateway had there when it reported (an estimate of the other gateways' share).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.workers.client import EngineClient
from gateway.workers.heartbeat import check_worker_url
from wire.protocol import WorkerState

log = logging.getLogger(__name__)


class WorkerDirectory(Protocol):
    """Where discovered workers come from (RedisWorkerDirectory, DnsWorkerDirectory)."""

    async def members(self) -> dict[str, WorkerState | None]:
        """URL → its last reported state, if the directory has one. Raises when it cannot be read."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class RegistryConfig:
    poll_interval_s: float = 1.0
    state_timeout_s: float = 2.0
    unhealthy_after: int = 2  # consecutive failed polls that take a worker out of rotation

    def __post_init__(self) -> None:
        if self.poll_interval_s <= 0 or self.state_timeout_s <= 0:
            raise ValueError("poll_interval_s and state_timeout_s must be > 0")
        if self.unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {self.unhealthy_after}")


@dataclass(eq=False)
class WorkerHandle:
    """One worker and what this gateway knows about it. Mutated only on the gateway's event loop."""

    worker_id: str  # its URL
    client: EngineClient
    discovered: bool = False  # from the directory (else configured)
    healthy: bool = False
    state: WorkerState | None = None
    in_flight: int = 0  # requests this gateway has running there
    in_flight_at_report: int = 0  # ... when `state` was read
    failed_polls: int = 0
    adapters_sent: set[str] = field(default_factory=set)  # since the last state poll
    retired: bool = False  # left the registry; its client closes when its last request ends

    @property
    def load(self) -> int:
        reported = 0 if self.state is None else self.state.num_running + self.state.num_waiting
        return self.in_flight + max(0, reported - self.in_flight_at_report)

    @property
    def resident_adapters(self) -> frozenset[str]:
        reported = self.state.resident_adapters if self.state is not None else ()
        return frozenset(reported) | frozenset(self.adapters_sent)


class WorkerRegistry:
    def __init__(self, client_for: Callable[[str], EngineClient], *, urls: Sequence[str] = (),
                 directory: WorkerDirectory | None = None, config: RegistryConfig | None = None) -> None:
        """`client_for(url)` makes the client of a worker (called once per configured or discovered URL)."""
        if not urls and directory is None:
            raise ValueError("a worker registry needs worker URLs or a directory to discover them")
        self.config = config or RegistryConfig()
        self._client_for = client_for
        self._directory = directory
        self._removal_listeners: list[Callable[[str], None]] = []
        self._workers: dict[str, WorkerHandle] = {}
        self._pending: set[asyncio.Task] = set()  # immediate polls after a failure
        for url in urls:
            url = check_worker_url(url)
            if url in self._workers:
                raise ValueError(f"worker URL {url} is given twice")
            self._workers[url] = WorkerHandle(url, client_for(url))

    def add_removal_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(worker_id)` is called whenever a worker leaves the rotation or the registry."""
        self._removal_listeners.append(listener)

    def _removed(self, worker_id: str) -> None:
        for listener in self._removal_listeners:
            listener(worker_id)

    def healthy_workers(self) -> list[WorkerHandle]:
        return [w for w in self._workers.values() if w.healthy]

    def all_workers(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    async def refresh(self) -> None:
        """One poll: the directory (if any), then every worker's state, concurrently."""
        if self._directory is not None:
            await self._discover()
        await asyncio.gather(*(self._poll(w) for w in list(self._workers.values())))

    def mark_unreachable(self, worker: WorkerHandle, why: str) -> None:
        """A request could not reach `worker`: out of rotation until a poll succeeds."""
        if worker.healthy:
            log.warning("engine worker %s taken out of rotation: %s", worker.worker_id, why)
            self._removed(worker.worker_id)
        worker.healthy = False
        worker.failed_polls = max(worker.failed_polls, self.config.unhealthy_after)

    def check_soon(self, worker: WorkerHandle) -> None:
        """A request on `worker` failed mid-stream: poll it now rather than at the next tick."""
        task = asyncio.get_running_loop().create_task(self._poll(worker))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def release(self, worker: WorkerHandle) -> None:
        """A request routed to `worker` ended."""
        worker.in_flight -= 1
        if worker.retired and worker.in_flight == 0:
            await worker.client.close()

    @contextlib.asynccontextmanager
    async def polling(self) -> AsyncIterator[WorkerRegistry]:
        """Poll once (so health is known before traffic), then every poll_interval_s until exit."""
        await self._refresh_logged()

        async def poll_forever() -> None:
            while True:
                await asyncio.sleep(self.config.poll_interval_s)
                await self._refresh_logged()

        task = asyncio.get_running_loop().create_task(poll_forever(), name="worker-registry-poll")
        try:
            yield self
        finally:
            task.cancel()
            for pending in list(self._pending):
                pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        for worker in self._workers.values():
            await worker.client.close()
        self._workers.clear()
        if self._directory is not None:
            await self._directory.close()

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except Exception:  # the poll loop must survive anything one round throws
            log.exception("worker registry refresh failed")

    async def _discover(self) -> None:
        assert self._directory is not None
        try:
            members = await self._directory.members()
        except Exception as e:  # Redis or DNS down: keep what we have, configured and discovered alike
            log.warning("worker discovery failed: %s", e)
            return
        for url in members:
            if url not in self._workers:
                log.info("engine worker %s discovered", url)
                self._workers[url] = WorkerHandle(url, self._client_for(url), discovered=True)
        for url, worker in list(self._workers.items()):
            if worker.discovered and url not in members:
                log.warning("engine worker %s left the directory (heartbeat expired or DNS record gone), removed",
                            url)
                del self._workers[url]
                worker.healthy, worker.retired = False, True
                self._removed(url)
                if worker.in_flight == 0:
                    await worker.client.close()

    async def _poll(self, worker: WorkerHandle) -> None:
        in_flight = worker.in_flight
        try:
            state = await asyncio.wait_for(worker.client.state(), self.config.state_timeout_s)
        except Exception as e:  # unreachable, timed out, wrong secret, malformed
            worker.failed_polls += 1
            if worker.healthy and worker.failed_polls >= self.config.unhealthy_after:
                log.warning("engine worker %s taken out of rotation: %s", worker.worker_id, e)
                worker.healthy = False
                self._removed(worker.worker_id)
            return
        if not worker.healthy and not worker.retired:
            log.info("engine worker %s is in rotation", worker.worker_id)
            worker.healthy = True
        worker.state, worker.in_flight_at_report, worker.failed_polls = state, in_flight, 0
        worker.adapters_sent.clear()
