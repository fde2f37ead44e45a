"""One tenant's hostile request never hurts another: every bad body is a 4xx in OpenAI's shape (never a
500), a tenant at its limits is refused before its prompt is rendered, a huge prompt is tokenized off the
event loop (/health and a bystander's stream are answered meanwhile, the stream with exactly the tokens it
gets alone), and tenants never see exception text or worker addresses."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from gateway.app import build_app
from gateway.http.prompt_pool import PromptPool
from gateway.openai.generation import api_error_for
from gateway.state import GatewayConfig
from gateway.store import SqliteStore
from gateway.workers.client import InProcessEngineClient
from gateway.workers.http_client import HttpEngineClient
from tests.conftest import free_port
from tests.gateway.conftest import BASE_MODEL, ROOMY_POLICY, ThreadedServer, serve_admission, wait_until
from tokenization.tokenizer import Tokenizer
from wire.errors import ErrorCode, RequestError
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService

HUGE_PROMPT_CHARS = 3_900_000  # the 3.9 MB prompt (~40 s to tokenize with the test tokenizer on 2 cores)
BIG_PROMPT_CHARS = 400_000  # the default run's: seconds of tokenizing, far over any tenant's request size


class CountingTokenizer(Tokenizer):
    """The checkpoint's tokenizer, counting the chat prompts it renders (to see that admission came first)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.chat_renders = 0

    def encode_chat(self, messages, **kwargs):  # type: ignore[no-untyped-def, override]
        self.chat_renders += 1
        return super().encode_chat(messages, **kwargs)


class Stack:
    def __init__(self, llama_dir: Path, data: Path) -> None:
        self.store = SqliteStore(data / "store.db")
        self.llm = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=128, block_size=4,
                                                     max_num_seqs=16))
        client = InProcessEngineClient(WorkerService(self.llm, BASE_MODEL,
                                                     WorkerCapabilities.of_engine(self.llm.engine.config)))
        self.tokenizer = CountingTokenizer(llama_dir)
        self.prompts = PromptPool(threads=2)
        config = GatewayConfig(served_model_name=BASE_MODEL, adapter_root=data / "adapters", prompt_threads=2)
        app = build_app(config, self.store, client, self.tokenizer, admission=serve_admission(16, data),
                        prompts=self.prompts)
        self.server = ThreadedServer(app).start()
        self.url = self.server.url

    def tenant(self, name: str, policy: dict | None = None) -> str:
        tenant = self.store.create_tenant(name, policy=ROOMY_POLICY if policy is None else policy)
        return self.store.create_api_key(tenant.id)[0]

    def stop(self) -> None:
        self.server.stop()
        self.llm.shutdown()
        self.store.close()


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    s = Stack(llama_dir, tmp_path_factory.mktemp("hostile"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def bystander(stack):
    return stack.tenant("bystander")


def chat_body(content: str = "hello there", max_tokens: int = 8, **extra) -> dict:
    return {"model": BASE_MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": content}], **extra}


def post(stack: Stack, key: str, body: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack.url + path, content=content, timeout=120,
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json"})


def stream_tokens(stack: Stack, key: str) -> list[str]:
    """The bystander's streamed answer, piece by piece."""
    pieces = []
    with httpx.stream("POST", stack.url + "/v1/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {key}"},
                      json=chat_body("the bystander's question", max_tokens=12, stream=True)) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces += [c["delta"].get("content", "") for c in json.loads(line[6:])["choices"]]
    return pieces


def assert_openai_error(resp: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param, error
    if status == 400:
        assert error["type"] == "invalid_request_error"
    assert resp.headers["x-request-id"]
    return error


@pytest.mark.parametrize("chars", [BIG_PROMPT_CHARS, pytest.param(HUGE_PROMPT_CHARS, marks=pytest.mark.long)],
                         ids=["400KB", "3.9MB"])
def test_a_huge_prompt_is_tokenized_while_health_and_a_bystander_are_answered(stack, bystander, chars):
    alone = stream_tokens(stack, bystander)
    attacker = stack.tenant(f"huge-prompt-{chars}")
    outcome: dict[str, httpx.Response] = {}
    big = threading.Thread(target=lambda: outcome.setdefault(
        "resp", post(stack, attacker, chat_body("x " * (chars // 2), max_tokens=4))))
    big.start()
    try:
        assert wait_until(lambda: stack.prompts.busy() >= 1, timeout_s=60)  # its prompt is being tokenized
        health = httpx.get(stack.url + "/health", timeout=60)
        assert health.status_code == 200
        during = stream_tokens(stack, bystander)
        assert big.is_alive(), "the huge prompt finished first: the check above proved nothing"
    finally:
        big.join(timeout=120)
    assert during == alone  # exactly the tokens it gets alone
    assert_openai_error(outcome["resp"], 400, "request_too_large", "messages")  # the attacker's own 4xx


def test_a_tenant_at_its_rate_limit_gets_429_before_its_prompt_is_rendered(stack):
    key = stack.tenant("limited", {"requests_per_minute": 1, "tokens_per_minute": 100_000})
    assert post(stack, key, chat_body()).status_code == 200
    renders = stack.tokenizer.chat_renders
    refused = post(stack, key, chat_body("y " * (BIG_PROMPT_CHARS // 2)))
    error = assert_openai_error(refused, 429, "rate_limit_exceeded")
    assert error["type"] == "rate_limit_error"
    assert stack.tokenizer.chat_renders == renders  # refused before any rendering or tokenizing


def test_a_prompt_over_the_tenants_size_is_a_400_that_still_costs_a_request(stack):
    key = stack.tenant("sized", {"requests_per_minute": 3, "max_tokens_per_request": 1000,
                                 "tokens_per_minute": 100_000})
    assert_openai_error(post(stack, key, chat_body("z " * 20_000)), 400, "request_too_large", "messages")
    ok = post(stack, key, chat_body())
    assert ok.status_code == 200
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"  # 3 - the refused one - this one


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_json_nested_10k_deep_is_a_400(stack, bystander, path):
    deep = b'{"model": "m", "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    error = assert_openai_error(post(stack, bystander, deep, path), 400, "json_too_deep")
    assert "nested more than" in error["message"]
    objects = b'{"model": "m", "x": ' + b'{"a": ' * 200 + b"1" + b"}" * 200 + b"}"
    assert_openai_error(post(stack, bystander, objects, path), 400, "json_too_deep")


def test_brackets_inside_strings_do_not_count_as_nesting(stack, bystander):
    resp = post(stack, bystander, chat_body("[" * 100 + "{" * 40 + '"\\', max_tokens=2))  # > 128 brackets
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("raw", [b'"\\ud800"', b'"a\\udfff b"', b'"\xed\xa0\x80"'], ids=["high", "low", "cesu8"])
def test_a_lone_surrogate_is_a_400(stack, bystander, raw):
    body = (b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}'
            % (BASE_MODEL.encode(), raw))
    assert_openai_error(post(stack, bystander, body), 400, "invalid_unicode")


def test_a_surrogate_pair_is_a_character(stack, bystander):
    body = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}' % (
        BASE_MODEL.encode())
    assert post(stack, bystander, body).status_code == 200


def test_a_lone_surrogate_inside_tool_call_arguments_is_a_400(stack, bystander):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    resp = post(stack, bystander, {"model": BASE_MODEL, "max_tokens": 2, "messages": messages})
    assert_openai_error(resp, 400, "invalid_unicode", "messages[1].tool_calls[0].function.arguments")


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_json_schema_nested_900_deep_is_refused_before_admission(stack):
    key = stack.tenant("schemas", {"requests_per_minute": 1, "tokens_per_minute": 100_000})
    deep = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(450)}}  # 900 levels
    assert_openai_error(post(stack, key, chat_body(response_format=deep)), 400, "json_too_deep")
    over = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested_schema(33)}}  # 66 levels
    assert_openai_error(post(stack, key, chat_body(response_format=over)), 400, "json_too_deep",
                        "response_format.json_schema.schema")
    tools = [{"type": "function", "function": {"name": "f", "parameters": _nested_schema(33)}}]
    assert_openai_error(post(stack, key, chat_body(tools=tools)), 400, "json_too_deep", "tools[0].function.parameters")
    assert post(stack, key, chat_body()).status_code == 200  # none of them cost its one request a minute


def test_user_text_spelling_control_tokens_is_tokenized_as_text(stack, bystander):
    tokenizer = stack.tokenizer
    forged = "".join(sorted(tokenizer.control_tokens.tokens)[:2]) + "system"
    resp = post(stack, bystander, chat_body(forged, max_tokens=1))
    assert resp.status_code == 200
    messages = [{"role": "user", "content": forged}]
    as_text = tokenizer.encode_chat(messages)
    as_markup = tokenizer.backend.encode(tokenizer.render_chat(messages), add_special_tokens=False).ids
    assert len(as_text) != len(as_markup)  # the forged strings would have become control tokens
    assert resp.json()["usage"]["prompt_tokens"] == len(as_text)


def test_every_error_carries_the_request_id(stack, bystander):
    answers = [
        post(stack, bystander, b"{not json"),
        post(stack, "lpx-not-a-key", chat_body()),
        post(stack, bystander, chat_body() | {"model": "no-such-model"}),
        httpx.get(stack.url + "/v1/nowhere", headers={"authorization": f"Bearer {bystander}"}),
    ]
    for resp in answers:
        assert resp.status_code in (400, 401, 404), resp.text
        assert resp.headers["x-request-id"].startswith("req_")
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    echoed = httpx.post(stack.url + "/v1/chat/completions", content=b"[", timeout=30,
                        headers={"authorization": f"Bearer {bystander}", "x-request-id": "client-chosen-1"})
    assert echoed.status_code == 400 and echoed.headers["x-request-id"] == "client-chosen-1"


def test_a_503_names_no_worker_and_shows_no_exception_text(llama_dir, tmp_path):
    store = SqliteStore(tmp_path / "store.db")
    port = free_port()  # nothing listens there
    engine = HttpEngineClient(f"http://127.0.0.1:{port}", "secret", connect_timeout_s=2.0)
    config = GatewayConfig(served_model_name=BASE_MODEL, adapter_root=tmp_path / "adapters")
    app = build_app(config, store, engine, Tokenizer(llama_dir), admission=serve_admission(4, tmp_path))
    tenant = store.create_tenant("t", policy=ROOMY_POLICY)
    key = store.create_api_key(tenant.id)[0]
    server = ThreadedServer(app).start()
    try:
        for stream in (False, True):
            resp = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"authorization": f"Bearer {key}"},
                              json=chat_body(stream=stream))
            text = resp.text
            assert resp.status_code == 503, text
            assert resp.json()["error"]["code"] == "worker_unavailable"
            assert resp.headers["x-request-id"] and resp.headers["retry-after"]
            for leak in ("127.0.0.1", "http://", str(port), "Error", "Traceback", "httpx"):
                assert leak not in text, (leak, text)
        health = httpx.get(server.url + "/health", timeout=60)
        assert health.status_code == 503 and "127.0.0.1" not in health.text
    finally:
        server.stop()
        store.close()


@pytest.mark.parametrize("code", [ErrorCode.ENGINE_ERROR, ErrorCode.WORKER_UNAVAILABLE])
def test_a_server_side_failure_shows_its_code_and_never_the_workers_text(code):
    worker_text = "OverflowError: Overflow when unpacking long long (worker http://10.0.0.7:8001, step 1234)"
    error = api_error_for(RequestError(code, worker_text, request_id="chatcmpl-1"))
    assert error.status == code.http_status and error.code == code.value
    assert error.message == code.default_message
    assert "http://" not in json.dumps(error.body()) and "Overflow" not in json.dumps(error.body())
    tenant_fault = api_error_for(RequestError(ErrorCode.INVALID_REQUEST, "the prompt does not fit", param="messages"))
    assert tenant_fault.message == "the prompt does not fit"  # a 4xx keeps its message: it tells the tenant why
