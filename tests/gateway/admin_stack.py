"""A live gateway for the admin, metrics, tracing and dashboard tests.

Real uvicorn on a free loopback port, serve's admission (memory quota backend + fair queue) so limits
are enforced, and the tiny llama engine — in process, or behind a real HTTP worker (its own uvicorn) when
`http_worker=True`, so trace context crosses the wire as it does in production.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from gateway.app import build_app
from gateway.observability.telemetry import Telemetry, TelemetryConfig
from gateway.state import GatewayConfig
from gateway.store import SqliteStore, Tenant
from gateway.workers.client import InProcessEngineClient
from gateway.workers.http_client import HttpEngineClient
from tests.gateway.conftest import BASE_MODEL, ThreadedServer, serve_admission
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService, build_worker_app

WORKER_SECRET = "admin-test-secret"


@dataclass
class AdminStack:
    url: str
    store: SqliteStore
    llm: AsyncLLM
    telemetry: Telemetry
    admin_key: str
    tenant: Tenant
    tenant_key: str
    gateway_spans: InMemorySpanExporter
    worker_spans: InMemorySpanExporter
    servers: list[ThreadedServer] = field(default_factory=list)

    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"}

    def chat(self, key: str, content: str = "hello there", max_tokens: int = 4, **headers: str) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", timeout=60,
                          headers={"authorization": f"Bearer {key}", **headers},
                          json={"model": BASE_MODEL, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "messages": [{"role": "user", "content": content}]})

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        self.llm.shutdown()
        self.store.close()


def start_admin_stack(llama_dir: Path, data_dir: Path, *, http_worker: bool = False,
                      telemetry_config: TelemetryConfig | None = None) -> AdminStack:
    store = SqliteStore(data_dir / "store.db")
    llm = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=128, block_size=4,
                                            max_num_seqs=8))
    worker_spans, gateway_spans = InMemorySpanExporter(), InMemorySpanExporter()
    worker_provider = TracerProvider()
    worker_provider.add_span_processor(SimpleSpanProcessor(worker_spans))
    service = WorkerService(llm, BASE_MODEL, WorkerCapabilities.of_engine(llm.engine.config), worker_provider)
    servers = []
    if http_worker:
        worker = ThreadedServer(build_worker_app(service, WORKER_SECRET)).start()
        servers.append(worker)
        engine = HttpEngineClient(worker.url, WORKER_SECRET)
    else:
        engine = InProcessEngineClient(service)
    config = telemetry_config or TelemetryConfig(activity_bucket_s=1.0, activity_window_s=120.0,
                                                 sample_interval_s=0.25)
    telemetry = Telemetry(config, span_exporters=[gateway_spans])
    app = build_app(GatewayConfig(served_model_name=BASE_MODEL, adapter_root=data_dir / "adapters"), store, engine,
                    llm.tokenizer, admission=serve_admission(8, data_dir), telemetry=telemetry)
    operators = store.create_tenant("operators")
    admin_key, _ = store.create_api_key(operators.id, scopes={"admin"}, name="ops")
    tenant = store.create_tenant("acme")
    tenant_key, _ = store.create_api_key(tenant.id, name="acme-app")
    servers.append(ThreadedServer(app).start())
    return AdminStack(servers[-1].url, store, llm, telemetry, admin_key, tenant, tenant_key, gateway_spans,
                      worker_spans, servers)
