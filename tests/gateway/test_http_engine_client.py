"""The worker's HTTP service (worker/server.py) through the gateway's HttpEngineClient."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from gateway.workers.http_client import HttpEngineClient
from tests.conftest import free_port
from tests.gateway.conftest import ThreadedServer, wait_until
from wire.errors import ErrorCode, RequestError
from wire.protocol import WORKER_SECRET_HEADER, AdapterSpec, GenerateRequest, parse_message
from wire.sampling import SamplingParams
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService, build_worker_app

SECRET = "s3cret-for-tests"


@pytest.fixture(scope="module")
def worker(llama_dir):
    llm = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=64, block_size=4))
    server = ThreadedServer(build_worker_app(WorkerService(llm, "tiny", WorkerCapabilities.of_engine(llm.engine.config)), SECRET)).start()
    yield server, llm
    server.stop()
    llm.shutdown()


def _request(rid: str, max_tokens: int = 5, prompt: list[int] | None = None, **sampling) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return GenerateRequest(rid, prompt or [5, 6, 7, 8, 9], params, priority=1, cache_salt="t1",
                           traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


def _failure(request: GenerateRequest, url: str, secret: str = SECRET) -> RequestError:
    with pytest.raises(RequestError) as info:
        _run(_collect(HttpEngineClient(url, secret), request))
    return info.value


def _run(coro):
    return asyncio.run(coro)


async def _collect(client: HttpEngineClient, request: GenerateRequest):
    try:
        return [d async for d in client.generate(request)]
    finally:
        await client.close()


def test_generate_streams_deltas_until_finished(worker):
    server, _ = worker
    deltas = _run(_collect(HttpEngineClient(server.url, SECRET), _request("w1", logprobs=1)))
    assert deltas[-1].finished and deltas[-1].samples[0].finish_reason == "length"
    assert [len(d.samples[0].token_ids) for d in deltas] == [1] * 5  # one new token per delta
    assert all(d.num_prompt_tokens == 5 for d in deltas)
    assert all(len(lp.top) == 1 for d in deltas for lp in d.samples[0].logprobs)


def test_invalid_requests_and_unloadable_adapters_are_coded_errors(worker):
    server, _ = worker
    refused = _failure(_request("w2", prompt=[10**7]), server.url)
    assert refused.code is ErrorCode.INVALID_REQUEST and "outside the vocabulary" in refused.message
    adapter_req = GenerateRequest("w4", [5, 6], SamplingParams(max_tokens=2),
                                  adapter=AdapterSpec("bot", "c" * 64, "/nowhere"))
    unloadable = _failure(adapter_req, server.url)
    assert unloadable.code is ErrorCode.ADAPTER_UNAVAILABLE and "bot" in unloadable.message
    assert "/nowhere" not in unloadable.message  # the cause is logged on the worker, not shown
    # A body the worker cannot decode is one error line naming the field, with status 400.
    body = {**_request("w3").to_json(), "sampling": {"max_tokens": 2, "bogus": 1}}
    bad = httpx.post(server.url + "/generate", headers={WORKER_SECRET_HEADER: SECRET}, json=body)
    error = parse_message(bad.content)
    assert bad.status_code == 400 and isinstance(error, RequestError) and "bogus" in error.message


def test_wrong_secret_and_unreachable_worker(worker):
    server, _ = worker
    for path in ("/health", "/state"):
        assert httpx.get(server.url + path, headers={WORKER_SECRET_HEADER: "nope"}).status_code == 401
    assert httpx.post(server.url + "/generate", json={}).status_code == 401
    bad = httpx.post(server.url + "/generate", headers={WORKER_SECRET_HEADER: SECRET}, json={"request_id": "x"})
    assert bad.status_code == 400 and "missing" in bad.json()["message"]
    assert _failure(_request("w5"), server.url, "nope").code is ErrorCode.WORKER_UNAVAILABLE
    gone_url = f"http://127.0.0.1:{free_port()}"
    gone = _failure(_request("w6"), gone_url)
    assert gone.code is ErrorCode.WORKER_UNAVAILABLE and gone.message == ErrorCode.WORKER_UNAVAILABLE.default_message
    assert gone_url not in gone.message and "127.0.0.1" not in gone.message  # logged, never shown

    async def health():
        ok = HttpEngineClient(server.url, SECRET)
        wrong = HttpEngineClient(server.url, "nope")
        try:
            return await ok.healthy(), await wrong.healthy(), await ok.state()
        finally:
            await ok.close()
            await wrong.close()

    good, refused, state = _run(health())
    assert good and not refused and state.model == "tiny" and state.num_kv_blocks == 64


def test_closing_the_stream_aborts_in_the_worker(worker):
    server, llm = worker

    async def go():
        client = HttpEngineClient(server.url, SECRET)
        stream = client.generate(_request("w7", max_tokens=1500))
        first = await anext(stream)
        assert not first.finished and llm.stats().num_running == 1
        await stream.aclose()
        await asyncio.sleep(0.3)  # the background /abort finishes
        await client.close()

    _run(go())
    assert wait_until(lambda: not llm.engine.has_unfinished_requests(), timeout_s=10)
    assert llm.stats().num_running == 0
