"""A live gateway that takes adapter uploads (uvicorn on loopback, in-process engine), and PEFT adapters
made with peft for it. Shared by the adapter upload and adapters CLI tests."""

from __future__ import annotations

import contextlib
import io
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from adapters.archive import ArchiveLimits
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig, ModelConfig
from gateway.adapters.registry import AdapterUploadConfig
from gateway.app import build_app
from gateway.state import GatewayConfig
from gateway.store import SqliteStore, Store
from gateway.workers.client import InProcessEngineClient
from tests.gateway.conftest import BASE_MODEL, ThreadedServer, serve_admission
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService

# The gateway's engine and the offline reference LLM run with the same settings.
ENGINE_ARGS = {"num_kv_blocks": 256, "block_size": 4, "max_num_seqs": 8, "max_loras": 4, "max_lora_rank": 8}
MAX_UPLOAD_BYTES = 2 << 20
TIGHT_BYTES = 4096  # tenant "tight": fewer adapter bytes than one test adapter holds
LORA_ARGS = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@dataclass
class AdapterServer:
    url: str
    store: Store
    llm: AsyncLLM
    adapter_root: Path
    keys: dict[str, str]  # tenant name -> API key
    tenant_ids: dict[str, str]

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}"}

    def upload(self, tenant: str, archive: bytes, name: str | None = "bot", filename: str = "adapter.tar.gz",
               **fields: str) -> httpx.Response:
        data = {**({"name": name} if name is not None else {}), **fields}
        return httpx.post(self.v1 + "/adapters", headers=self.headers(tenant), data=data,
                          files={"file": (filename, archive, "application/gzip")}, timeout=60)

    def stored_entries(self) -> set[str]:
        """Every path under the adapter root (temporaries included), relative to it. The server removes its
        temporary directories while a test may be walking them: a directory gone mid-walk starts the walk over."""
        for _ in range(100):
            try:
                return {str(p.relative_to(self.adapter_root)) for p in self.adapter_root.rglob("*")}
            except FileNotFoundError:
                continue
        return {str(p.relative_to(self.adapter_root)) for p in self.adapter_root.rglob("*")}

    def records(self, tenant: str, name: str) -> list:
        return [r for r in self.store.list_adapters(self.tenant_ids[tenant], include_shared=False,
                                                    include_deleted=True) if r.name == name]


@contextlib.contextmanager
def running_adapter_server(model_dir: Path, data_dir: Path, max_upload_bytes: int = MAX_UPLOAD_BYTES,
                           engine_options: dict | None = None, **gateway_options) -> Iterator[AdapterServer]:
    """Tenants acme and globex (defaults), tight (TIGHT_BYTES of adapters) and single (one adapter).
    `gateway_options`: GatewayConfig fields over the defaults here (e.g. upload_read_timeout_s);
    `engine_options`: EngineConfig fields over ENGINE_ARGS (e.g. num_kv_blocks)."""
    store = SqliteStore(data_dir / "store.db")
    llm = AsyncLLM.from_config(EngineConfig(model=str(model_dir), **{**ENGINE_ARGS, **(engine_options or {})}))
    client = InProcessEngineClient(WorkerService(llm, BASE_MODEL, WorkerCapabilities.of_engine(llm.engine.config)))
    config = GatewayConfig(served_model_name=BASE_MODEL, adapter_root=data_dir / "adapters",
                           max_body_bytes=64 * 1024, **gateway_options)
    uploads = AdapterUploadConfig(ModelConfig.from_pretrained(model_dir), max_lora_rank=ENGINE_ARGS["max_lora_rank"],
                                  max_upload_bytes=max_upload_bytes, archive_limits=ArchiveLimits(max_total_bytes=64 << 20))
    app = build_app(config, store, client, llm.tokenizer, admission=serve_admission(ENGINE_ARGS["max_num_seqs"], data_dir),
                    adapter_uploads=uploads)
    policies = {"acme": {}, "globex": {}, "tight": {"max_adapter_bytes": TIGHT_BYTES}, "single": {"max_adapters": 1}}
    keys, ids = {}, {}
    for name, policy in policies.items():
        tenant = store.create_tenant(name, policy=policy)
        keys[name], _ = store.create_api_key(tenant.id)
        ids[name] = tenant.id
    server = ThreadedServer(app).start()
    try:
        yield AdapterServer(server.url, store, llm, data_dir / "adapters", keys, ids)
    finally:
        server.stop()
        llm.shutdown()
        store.close()


def tar_gz(members: dict[str, bytes]) -> bytes:
    """A .tar.gz of regular files (name -> content), in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def adapter_files(adapter_dir: Path) -> dict[str, bytes]:
    return {name: (adapter_dir / name).read_bytes()
            for name in ("adapter_config.json", "adapter_model.safetensors")}
