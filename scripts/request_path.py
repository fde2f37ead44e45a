"""Count the project modules whose code runs while the gateway serves one streamed chat request.

The request goes through the app `loraplex serve` builds (its quota admission and fair queue, a SQLite
store) to an in-process worker service over a tiny random model, so the count covers the gateway, the
worker service and the engine in one process (the HTTP hop to a worker process adds the two transport
modules, gateway/workers/http_client.py and http_pool.py). Run: .venv/bin/python scripts/request_path.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACTIVE = [False]
SEEN: set[str] = set()


def _profile(frame, event, arg):  # noqa: ANN001
    if ACTIVE[0] and event == "call":
        name = frame.f_code.co_filename
        if name.startswith(str(ROOT)) and "/tests/" not in name and "/.venv/" not in name:
            SEEN.add(name[len(str(ROOT)) + 1:])


def main() -> int:
    threading.setprofile(_profile)  # before any thread starts: the engine loop and the app's portal
    sys.path.insert(0, str(ROOT))
    from starlette.testclient import TestClient

    from demo.checkpoint import FAMILIES, make_checkpoint, train_tokenizer
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from gateway.admission.settings import QuotaSettings, build_admission, build_quota_backend
    from gateway.app import build_app
    from gateway.state import GatewayConfig
    from gateway.store import SqliteStore
    from gateway.workers.client import InProcessEngineClient
    from worker.capabilities import WorkerCapabilities
    from worker.server import WorkerService

    tmp = Path(tempfile.mkdtemp())
    model = make_checkpoint(tmp / "model", FAMILIES["llama"], tokenizer_dir=train_tokenizer(tmp / "tok", "byte_bpe"))
    store = SqliteStore(tmp / "store.db")
    llm = AsyncLLM.from_config(EngineConfig(model=str(model), num_kv_blocks=128, block_size=4, max_num_seqs=16))
    client = InProcessEngineClient(WorkerService(llm, "tiny", WorkerCapabilities.of_engine(llm.engine.config)))
    settings = QuotaSettings(queue_capacity=16)
    app = build_app(GatewayConfig(served_model_name="tiny", adapter_root=tmp / "adapters"), store, client,
                    llm.tokenizer, admission=build_admission(settings, build_quota_backend(settings, data_dir=tmp)))
    tenant = store.create_tenant("a", policy={"requests_per_minute": 1000})
    key, _ = store.create_api_key(tenant.id)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(app) as http:
        assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200  # warm
        ACTIVE[0] = True
        sys.setprofile(_profile)
        response = http.post("/v1/chat/completions", json=body, headers=headers)
        sys.setprofile(None)
        ACTIVE[0] = False
        assert response.status_code == 200, response.text
    llm.shutdown()
    print(f"{len(SEEN)} modules")
    for name in sorted(SEEN):
        print(" ", name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
