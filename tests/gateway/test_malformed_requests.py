"""Malformed requests each get a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import BASE_MODEL

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": BASE_MODEL, "messages": MSG, "max_tokens": 2}
COMP = {"model": BASE_MODEL, "prompt": "hi", "max_tokens": 2}


def _cases() -> list[tuple[str, str, object, int]]:
    """(path, label, json body or raw bytes, expected status)."""
    chat, comp = "/chat/completions", "/completions"
    cases: list[tuple[str, str, object, int]] = []

    def c(path: str, label: str, body: object, status: int = 400) -> None:
        cases.append((path, label, body, status))

    c(chat, "missing model", {"messages": MSG})
    c(chat, "missing messages", {"model": BASE_MODEL})
    c(chat, "empty messages", {**CHAT, "messages": []})
    c(chat, "messages not a list", {**CHAT, "messages": "hi"})
    c(chat, "message not an object", {**CHAT, "messages": ["hi"]})
    c(chat, "unknown role", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]})
    c(chat, "content wrong type", {**CHAT, "messages": [{"role": "user", "content": 5}]})
    c(chat, "content part without text", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    c(chat, "model wrong type", {**CHAT, "model": 7})
    c(chat, "model empty", {**CHAT, "model": ""})
    c(chat, "unknown model", {**CHAT, "model": "gpt-17"}, 404)
    c(chat, "max_tokens negative", {**CHAT, "max_tokens": -1})
    c(chat, "max_tokens zero", {**CHAT, "max_tokens": 0})
    c(chat, "max_tokens string", {**CHAT, "max_tokens": "5"})
    c(chat, "max_tokens float", {**CHAT, "max_tokens": 2.5})
    c(chat, "max_completion_tokens negative", {**CHAT, "max_completion_tokens": -3})
    c(chat, "temperature too high", {**CHAT, "temperature": 3})
    c(chat, "temperature string", {**CHAT, "temperature": "hot"})
    c(chat, "top_p above 1", {**CHAT, "top_p": 1.5})
    c(chat, "huge n", {**CHAT, "n": 100000})
    c(chat, "n zero", {**CHAT, "n": 0})
    c(chat, "n bool", {**CHAT, "n": True})
    c(chat, "stop wrong type", {**CHAT, "stop": 3})
    c(chat, "too many stops", {**CHAT, "stop": ["a", "b", "c", "d", "e"]})
    c(chat, "empty stop", {**CHAT, "stop": [""]})
    c(chat, "seed string", {**CHAT, "seed": "42"})
    c(chat, "presence penalty out of range", {**CHAT, "presence_penalty": 5})
    c(chat, "frequency penalty wrong type", {**CHAT, "frequency_penalty": [1]})
    c(chat, "logprobs wrong type", {**CHAT, "logprobs": "yes"})
    c(chat, "top_logprobs too many", {**CHAT, "logprobs": True, "top_logprobs": 50})
    c(chat, "top_logprobs without logprobs", {**CHAT, "top_logprobs": 2})
    c(chat, "stream wrong type", {**CHAT, "stream": "true"})
    c(chat, "stream_options wrong type", {**CHAT, "stream": True, "stream_options": 1})
    c(chat, "response_format unknown type", {**CHAT, "response_format": {"type": "xml"}})
    c(chat, "json_schema without schema", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}})
    c(chat, "priority wrong type", {**CHAT, "priority": "high"})
    c(chat, "user wrong type", {**CHAT, "user": 12})
    c(chat, "body is a list", [CHAT])
    c(chat, "body is a string", "hello")
    c(chat, "invalid json", b'{"model": "x", "messages": [')
    c(chat, "not utf-8", b"\xff\xfe\x00garbage")
    c(chat, "empty body", b"")
    c(chat, "prompt beyond the context", {**CHAT, "messages": [{"role": "user", "content": "hi " * 3000}]})
    c(chat, "oversized body", {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}, 413)
    c(comp, "missing prompt", {"model": BASE_MODEL})
    c(comp, "prompt wrong type", {**COMP, "prompt": {"text": "hi"}})
    c(comp, "prompt token out of vocab", {**COMP, "prompt": [1, 2, 10**9]})
    c(comp, "empty prompt", {**COMP, "prompt": ""})
    c(comp, "logprobs too many", {**COMP, "logprobs": 21})
    c(comp, "echo with logprobs", {**COMP, "echo": True, "logprobs": 1})
    c(comp, "too many prompts", {**COMP, "prompt": ["a"] * 65})
    c(comp, "negative max_tokens", {**COMP, "max_tokens": -7})
    return cases


def test_fifty_malformed_requests_get_4xx_in_openais_shape(gateway_stack):
    cases = _cases()
    assert len(cases) >= 50
    headers = {"authorization": f"Bearer {gateway_stack.key_a}", "content-type": "application/json"}
    with httpx.Client(base_url=gateway_stack.v1, headers=headers, timeout=30) as http:
        for path, label, body, status in cases:
            resp = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
            assert resp.status_code == status, f"{label}: {resp.status_code} {resp.text}"
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, label
            assert error["type"] == "invalid_request_error" and error["message"], label
            assert resp.headers["x-request-id"], label
        resp = http.post("/chat/completions", json=CHAT)
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["role"] == "assistant"


def test_wrong_type_names_the_param(gateway_stack):
    headers = {"authorization": f"Bearer {gateway_stack.key_a}"}
    resp = httpx.post(gateway_stack.v1 + "/chat/completions", headers=headers, timeout=30,
                      json={**CHAT, "messages": [{"role": "user", "content": 5}]})
    assert resp.json()["error"]["param"] == "messages[0].content"
    resp = httpx.post(gateway_stack.v1 + "/chat/completions", headers=headers, timeout=30, json={**CHAT, "n": "2"})
    assert resp.json()["error"]["param"] == "n" and resp.json()["error"]["code"] == "invalid_type"


def test_values_out_of_bounds_are_refused_once_by_sampling_params_naming_the_param(gateway_stack):
    headers = {"authorization": f"Bearer {gateway_stack.key_a}"}
    cases = [("/chat/completions", {**CHAT, "temperature": 3}, "temperature"),
             ("/chat/completions", {**CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
             ("/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
             ("/chat/completions", {**CHAT, "min_tokens": 5}, "min_tokens"),
             ("/completions", {**COMP, "logprobs": 21}, "logprobs"), ("/completions", {**COMP, "top_p": -1}, "top_p")]
    for path, body, param in cases:
        resp = httpx.post(gateway_stack.v1 + path, headers=headers, json=body, timeout=30)
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["param"] == param and error["code"] == "invalid_value", error


def test_chunked_oversized_body_is_413_while_reading(gateway_stack):
    def chunks():
        for _ in range(200):
            yield b"x" * 1024

    headers = {"authorization": f"Bearer {gateway_stack.key_a}"}
    resp = httpx.post(gateway_stack.v1 + "/chat/completions", headers=headers, content=chunks(), timeout=30)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_are_openai_shaped(gateway_stack):
    headers = {"authorization": f"Bearer {gateway_stack.key_a}"}
    resp = httpx.get(gateway_stack.v1 + "/chat/completions", headers=headers)
    assert resp.status_code == 405 and resp.json()["error"]["type"] == "invalid_request_error"
    resp = httpx.post(gateway_stack.v1 + "/embeddings", headers=headers, json={})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "unknown_url"
