"""A live gateway for the fuzz tests: uvicorn on a free loopback port over an in-process engine on the
tiny demo model, adapter uploads on, two tenants — `fuzzer` (the attacker, a roomy policy) and
`bystander` (whose streamed completions must not change while the fuzzer runs). One stack serves the
package: its modules carry `xdist_group("fuzz")`, so xdist's loadgroup keeps them in one worker."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.applications import Starlette

from adapters.archive import ArchiveLimits
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig, ModelConfig
from gateway.adapters.registry import AdapterUploadConfig
from gateway.app import build_app
from gateway.state import GatewayConfig
from gateway.store import SqliteStore
from gateway.workers.client import InProcessEngineClient
from tests.gateway.conftest import BASE_MODEL, ROOMY_POLICY, ThreadedServer, serve_admission
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService

MAX_BODY_BYTES = 64 * 1024
MAX_UPLOAD_BYTES = 256 * 1024
# The fuzzer's requests stay small on the engine: a generated max_tokens above this is a 400, not minutes of
# decoding (the policy's own refusal path is fuzzed too).
FUZZER_POLICY = {**ROOMY_POLICY, "max_tokens_per_request": 4096}


@dataclass
class FuzzStack:
    url: str
    app: Starlette
    store: SqliteStore
    llm: AsyncLLM
    fuzzer_key: str
    bystander_key: str

    def headers(self, key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {key}"}


@pytest.fixture(scope="package")
def fuzz_stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    data = tmp_path_factory.mktemp("fuzz")
    store = SqliteStore(data / "store.db")
    llm = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=256, block_size=4, max_num_seqs=16,
                                            max_loras=2, max_lora_rank=8))
    client = InProcessEngineClient(WorkerService(llm, BASE_MODEL, WorkerCapabilities.of_engine(llm.engine.config)))
    config = GatewayConfig(served_model_name=BASE_MODEL, adapter_root=data / "adapters", max_body_bytes=MAX_BODY_BYTES,
                           default_max_tokens=16)
    uploads = AdapterUploadConfig(ModelConfig.from_pretrained(llama_dir), max_lora_rank=8,
                                  max_upload_bytes=MAX_UPLOAD_BYTES, archive_limits=ArchiveLimits(max_total_bytes=4 << 20))
    app = build_app(config, store, client, llm.tokenizer, admission=serve_admission(64, data), adapter_uploads=uploads)
    fuzzer = store.create_tenant("fuzzer", policy=FUZZER_POLICY)
    bystander = store.create_tenant("bystander", policy=ROOMY_POLICY)
    fuzzer_key, _ = store.create_api_key(fuzzer.id)
    bystander_key, _ = store.create_api_key(bystander.id)
    server = ThreadedServer(app).start()
    yield FuzzStack(server.url, app, store, llm, fuzzer_key, bystander_key)
    server.stop()
    llm.shutdown()
    store.close()


@pytest.fixture(scope="package", autouse=True)
def hypothesis_as_found():
    """Schemathesis' `setup()` (run by `as_strategy`) patches Hypothesis' globals once per process (its
    buffer size, a printer that prints nothing, the PRNG registration). Put them back after each fuzz
    module, so tests that run later in the same process generate and report examples as they would alone."""
    from hypothesis import core as root_core
    from hypothesis.internal import entropy
    from hypothesis.internal.conjecture import engine
    from hypothesis.strategies._internal import collections, core
    from schemathesis.generation import hypothesis as schemathesis_hypothesis

    missing = object()
    patched = [(root_core, "RepresentationPrinter"), (root_core, "BUFFER_SIZE"), (engine, "BUFFER_SIZE"),
               (collections, "BUFFER_SIZE"), (core, "is_first_param_referenced_in_function"),
               (entropy, "register_random")]
    saved = [(owner, name, getattr(owner, name, missing)) for owner, name in patched]
    yield
    for owner, name, value in saved:
        if value is missing:
            if hasattr(owner, name):
                delattr(owner, name)
        else:
            setattr(owner, name, value)
    schemathesis_hypothesis.setup._is_patched = False  # type: ignore[attr-defined]
