"""Real processes for the quota tests: redis-server, a null engine worker, `loraplex serve --worker-url`.

Also an in-process gateway (uvicorn thread) with the admission `loraplex serve` builds (`build_admission`
over a quota backend the test keeps a handle on) and an HTTP null worker, for tests that look at the queue
and the quota counters themselves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import free_port, wait_for_redis

REPO = Path(__file__).resolve().parents[2]
SECRET = "quota-test-secret"
MODEL_NAME = "null-model"


class Process:
    """A child process whose output is kept (shown when it fails to start)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})}, cwd=REPO)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def tail(self) -> str:
        return "\n".join(self.lines[-30:])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def wait_http(url: str, process: Process, timeout_s: float = 60.0, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.proc.poll() is None, f"process exited:\n{process.tail()}"
        try:
            if httpx.get(url, timeout=1, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy:\n{process.tail()}")


def start_redis(data_dir: Path) -> tuple[Process, str]:
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is not installed: run scripts/setup.sh"
    port = free_port()
    proc = Process([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(data_dir)])
    url = f"redis://127.0.0.1:{port}/0"
    wait_for_redis(url)
    return proc, url


def start_null_worker(token_delay_ms: float = 0.0) -> tuple[Process, str]:
    """Starts a null worker; call wait_null_worker() before use (lets several start in parallel)."""
    port = free_port()
    proc = Process([sys.executable, "-m", "demo.null_worker", "--port", str(port),
                    "--token-delay-ms", str(token_delay_ms), "--model-name", MODEL_NAME],
                   env={"LORAPLEX_WORKER_SECRET": SECRET})
    return proc, f"http://127.0.0.1:{port}"


def wait_null_worker(proc: Process, url: str) -> None:
    wait_http(url + "/health", proc, headers={"x-loraplex-worker-secret": SECRET})


@dataclass
class GatewayProcess:
    process: Process
    url: str

    def wait(self) -> GatewayProcess:
        wait_http(self.url + "/health", self.process)
        return self

    def kill(self) -> None:
        self.process.stop(signal.SIGKILL)

    def stop(self) -> None:
        self.process.stop(signal.SIGINT)


def start_gateway(model_dir: Path, data_dir: Path, worker_url: str, *extra: str,
                  env: dict[str, str] | None = None) -> GatewayProcess:
    """`loraplex serve --worker-url ...` (call .wait() before use)."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway.cli.main", "serve", "--model", str(model_dir), "--served-model-name",
            MODEL_NAME, "--worker-url", worker_url, "--port", str(port), "--data-dir", str(data_dir), *extra]
    process = Process(argv, env={"LORAPLEX_WORKER_SECRET": SECRET, **(env or {})})
    return GatewayProcess(process, f"http://127.0.0.1:{port}")


def completion_body(prompt_tokens: int, max_tokens: int, **extra) -> dict:
    """A /v1/completions body whose reservation is exactly prompt_tokens + max_tokens."""
    return {"model": MODEL_NAME, "prompt": list(range(1, prompt_tokens + 1)), "max_tokens": max_tokens, **extra}


@dataclass
class InProcessGateway:
    """A gateway app over SQLite in a uvicorn thread, with serve's admission, on an HTTP worker."""

    url: str
    store: object  # gateway.store.Store
    admission: object  # gateway.admission.gates.GatedAdmission
    quota: object  # policies.QuotaBackend: the admission's quota gate counts here
    server: object  # tests.gateway.conftest.ThreadedServer

    def new_tenant(self, name: str, policy: dict) -> str:
        tenant = self.store.create_tenant(name, policy=policy)
        return self.store.create_api_key(tenant.id)[0]

    def close(self) -> None:
        self.server.stop()
        self.store.close()


def in_process_gateway(model_dir: Path, data_dir: Path, worker_url: str, settings=None, *,
                       redis_url: str | None = None) -> InProcessGateway:
    """`settings`: a gateway.admission.settings.QuotaSettings (default: a queue of 4 slots); with `redis_url`
    the quota backend is serve's Redis one (failover included), else serve's memory one."""
    from gateway.admission.settings import QuotaSettings, build_admission, build_quota_backend
    from gateway.app import build_app
    from gateway.state import GatewayConfig
    from gateway.store import SqliteStore
    from gateway.workers.http_client import HttpEngineClient
    from tests.gateway.conftest import ThreadedServer
    from tokenization.tokenizer import Tokenizer

    settings = settings or QuotaSettings(queue_capacity=4)
    quota = build_quota_backend(settings, redis_url=redis_url, data_dir=data_dir)
    admission = build_admission(settings, quota)
    store = SqliteStore(data_dir / "store.db")
    config = GatewayConfig(served_model_name=MODEL_NAME, adapter_root=data_dir / "adapters")
    app = build_app(config, store, HttpEngineClient(worker_url, SECRET), Tokenizer(model_dir), admission=admission)
    server = ThreadedServer(app).start()
    return InProcessGateway(server.url, store, admission, quota, server)
