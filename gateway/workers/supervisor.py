"""Keeps one local engine worker subprocess alive for `loraplex serve`.

The worker is the worker's own command (`worker_argv`: `python -m worker ...`, worker/cli.py) on a loopback
port, with its shared secret passed in the environment (never on the command line, where `ps` would show it). If it exits, requests in flight
end with a clean error (their HTTP streams break: RequestError engine_error), requests meanwhile get 503, and
the supervisor starts a new one after a short backoff that grows while crashes repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.workers.http_client import HttpEngineClient

log = logging.getLogger(__name__)

SECRET_ENV = "LORAPLEX_WORKER_SECRET"  # read by worker/cli.py


def worker_argv(flags: Sequence[str]) -> list[str]:
    """The command line of an engine worker with these flags (worker/cli.py parses them), run by this
    interpreter. NOTE: `-P` keeps the current directory off sys.path, so that nothing there can shadow
    the installed `worker` package."""
    return [sys.executable, "-P", "-m", "worker", *flags]


@dataclass(frozen=True)
class WorkerLaunch:
    command: list[str]  # argv of the worker process (worker_argv)
    health_client: HttpEngineClient  # pointed at the worker's port, with the secret
    secret: str
    pid_file: Path | None = None  # where the current worker's pid is written (operators, tests)
    startup_timeout_s: float = 120.0
    min_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("the worker command is empty")
        if self.min_backoff_s <= 0 or self.max_backoff_s < self.min_backoff_s:
            raise ValueError("backoffs must satisfy 0 < min_backoff_s <= max_backoff_s")


class WorkerSupervisor:
    def __init__(self, launch: WorkerLaunch) -> None:
        self.launch = launch
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        self._monitor: asyncio.Task | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[WorkerSupervisor]:
        """Start the worker, wait until it is healthy, keep it alive until the block exits."""
        await self._spawn()
        await self._wait_healthy()
        self._monitor = asyncio.create_task(self._watch(), name="worker-supervisor")
        try:
            yield self
        finally:
            await self.stop()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        proc = self.process
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    async def _spawn(self) -> None:
        env = {**os.environ, **self.launch.extra_env, SECRET_ENV: self.launch.secret}
        self.process = await asyncio.create_subprocess_exec(*self.launch.command, env=env)
        if self.launch.pid_file is not None:
            self.launch.pid_file.write_text(f"{self.process.pid}\n")
        log.info("engine worker started (pid %d)", self.process.pid)

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.launch.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.returncode is not None:
                raise RuntimeError(f"the engine worker exited with code {self.process.returncode} while starting")
            if await self.launch.health_client.healthy():
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the engine worker was not healthy within {self.launch.startup_timeout_s:.0f} s")

    async def _watch(self) -> None:
        backoff = self.launch.min_backoff_s
        while not self._stopping:
            assert self.process is not None
            started = time.monotonic()
            code = await self.process.wait()
            if self._stopping:
                return
            log.error("engine worker (pid %d) exited with code %s; restarting in %.1f s", self.process.pid, code,
                      backoff)
            if time.monotonic() - started > 60:
                backoff = self.launch.min_backoff_s  # it ran a while: not a crash loop
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.launch.max_backoff_s)
            try:
                await self._spawn()
                await self._wait_healthy()
                self.restarts += 1
            except (RuntimeError, OSError) as e:
                log.error("engine worker restart failed: %s", e)
