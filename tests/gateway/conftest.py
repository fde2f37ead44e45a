"""Gateway fixtures: a real uvicorn server on a free loopback port over an in-process engine, with the
admission `loraplex serve` builds (gateway/admission/settings.py: memory quota backend, fair queue)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from gateway.admission.gates import GatedAdmission
from gateway.admission.settings import QuotaSettings, build_admission, build_quota_backend
from gateway.app import build_app
from gateway.state import GatewayConfig
from gateway.store import SqliteStore, Store, open_store
from gateway.workers.client import InProcessEngineClient
from tests.conftest import free_port
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService

BASE_MODEL = "tiny-llama"
# The fixture tenants' limits: room for every request a test module sends (the defaults allow 60 a minute).
ROOMY_POLICY = {"requests_per_minute": 100_000, "tokens_per_minute": 10_000_000, "max_concurrent_requests": 64,
                "max_queued_requests": 256}


def serve_admission(queue_capacity: int, data_dir: Path | None = None) -> GatedAdmission:
    """The admission `loraplex serve` builds without --redis-url (budget ledger in `data_dir`)."""
    settings = QuotaSettings(queue_capacity=queue_capacity)
    return build_admission(settings, build_quota_backend(settings, data_dir=data_dir))


class ThreadedServer:
    """uvicorn serving `app` from a background thread until stop()."""

    def __init__(self, app, port: int | None = None) -> None:
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@dataclass
class GatewayStack:
    url: str
    store: Store
    llm: AsyncLLM
    key_a: str
    key_b: str
    tenant_a: str
    tenant_b: str

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@pytest.fixture(scope="module")
def gateway_stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two tenants (a, b) with one key each, on a module-scoped server over a 128-block engine."""
    data = tmp_path_factory.mktemp("gateway")
    store = SqliteStore(data / "store.db")
    llm = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=128, block_size=4,
                                            max_num_seqs=16))
    client = InProcessEngineClient(WorkerService(llm, BASE_MODEL, WorkerCapabilities.of_engine(llm.engine.config)))
    config = GatewayConfig(served_model_name=BASE_MODEL, adapter_root=data / "adapters", max_body_bytes=64 * 1024)
    app = build_app(config, store, client, llm.tokenizer, admission=serve_admission(16, data))
    tenant_a = store.create_tenant("acme", policy=ROOMY_POLICY)
    tenant_b = store.create_tenant("globex", policy=ROOMY_POLICY)
    key_a, _ = store.create_api_key(tenant_a.id)
    key_b, _ = store.create_api_key(tenant_b.id)
    server = ThreadedServer(app).start()
    yield GatewayStack(server.url, store, llm, key_a, key_b, tenant_a.id, tenant_b.id)
    server.stop()
    llm.shutdown()
    store.close()


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """The store contract suite runs against each backend: a SQLite file, and a real redis-server."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'data' / 'store.db'}"
    return request.getfixturevalue("redis_server").url


@pytest.fixture()
def store(store_url: str):
    with open_store(store_url) as s:
        yield s
