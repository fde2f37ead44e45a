"""A 2,000-token stream through the real HTTP path (gateway → worker over NDJSON → SSE) costs O(1) per
step: every worker line and every SSE chunk has the same size whatever its position in the output."""

from __future__ import annotations

import json

import httpx
import pytest

import gateway.workers.http_client as http_client
from demo.null_worker import NULL_CAPABILITIES, NULL_TOKEN_TEXT, NullLLM
from gateway.app import build_app
from gateway.state import GatewayConfig
from gateway.store import SqliteStore
from gateway.workers.http_client import HttpEngineClient
from tests.gateway.conftest import ROOMY_POLICY, ThreadedServer, serve_admission
from tokenization.tokenizer import Tokenizer
from worker.server import WorkerService, build_worker_app

MODEL = "null-model"
SECRET = "chunk-test-secret"
LONG = 2000


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("chunks")
    worker = ThreadedServer(build_worker_app(WorkerService(NullLLM(), MODEL, NULL_CAPABILITIES), SECRET)).start()
    store = SqliteStore(data / "store.db")
    app = build_app(GatewayConfig(served_model_name=MODEL, adapter_root=data / "adapters"), store,
                    HttpEngineClient(worker.url, SECRET), Tokenizer(llama_dir), admission=serve_admission(4, data))
    gateway = ThreadedServer(app).start()
    tenant = store.create_tenant("streamer", policy=ROOMY_POLICY)
    key = store.create_api_key(tenant.id)[0]
    yield gateway.url + "/v1", key
    gateway.stop()
    worker.stop()
    store.close()


def _events(url: str, key: str, path: str, body: dict) -> list[str]:
    with httpx.Client(timeout=60) as http, http.stream("POST", url + path, json=body,
                                                       headers={"authorization": f"Bearer {key}"}) as resp:
        assert resp.status_code == 200, resp.read()
        return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_every_chunk_of_a_2000_token_stream_has_the_same_size(stack, monkeypatch, path):
    url, key = stack
    worker_lines: list[int] = []
    parse = http_client.parse_message

    def measured(line):  # what each step costs on the worker hop: one NDJSON line per delta
        worker_lines.append(len(line))
        return parse(line)

    monkeypatch.setattr(http_client, "parse_message", measured)
    prompt = {"prompt": "hi"} if path == "/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body = {"model": MODEL, "max_tokens": LONG, "stream": True, "stream_options": {"include_usage": True}, **prompt}
    events = _events(url, key, path, body)

    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == LONG
    chunks = events[:-2]
    assert len(chunks) == LONG and len(worker_lines) == LONG  # one chunk per token, one line per step
    choices = [json.loads(c)["choices"][0] for c in chunks]
    texts = [c["text"] if "text" in c else c["delta"]["content"] for c in choices]
    assert texts == [NULL_TOKEN_TEXT] * LONG
    # The first chat chunk also names the role and the last one the finish reason; all others are
    # byte-for-byte the same size at position 1 and at position 1,999.
    middle = {len(c) for c in chunks[1:-1]}
    assert len(middle) == 1 and len(chunks[-1]) <= len(chunks[1]) + 8
    assert len(set(worker_lines[:-1])) == 1 and worker_lines[-1] <= worker_lines[0] + 48
