"""The official openai client against a live gateway: models, chat, completions, streaming, errors."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.gateway.conftest import BASE_MODEL, wait_until


@pytest.fixture(scope="module")
def client(gateway_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_stack.v1, api_key=gateway_stack.key_a, max_retries=0, timeout=60)


def test_lists_and_retrieves_the_base_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [BASE_MODEL]
    assert client.models.retrieve(BASE_MODEL).id == BASE_MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


def test_chat_completion_reports_usage_and_text(client, gateway_stack):
    before = gateway_stack.store.usage_totals(gateway_stack.tenant_a, 0, time.time() + 3600)
    resp = client.chat.completions.create(
        model=BASE_MODEL, max_tokens=6, temperature=0, user="u1",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        extra_body={"ignore_eos": True, "some_future_field": {"x": 1}},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens > 5
    assert resp.id.startswith("chatcmpl-") and resp.model == BASE_MODEL
    # NOTE: usage is recorded when the request settles, which may be just after the client has its answer.
    assert wait_until(lambda: gateway_stack.store.usage_totals(
        gateway_stack.tenant_a, 0, time.time() + 3600).requests == before.requests + 1)
    after = gateway_stack.store.usage_totals(gateway_stack.tenant_a, 0, time.time() + 3600)
    assert after.requests == before.requests + 1
    assert after.completion_tokens == before.completion_tokens + 6
    assert after.prompt_tokens == before.prompt_tokens + resp.usage.prompt_tokens


def test_greedy_chat_is_deterministic_and_matches_its_stream(client):
    kwargs = dict(model=BASE_MODEL, max_completion_tokens=8, temperature=0,
                  messages=[{"role": "user", "content": "what is the cache"}], extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    # The same prompt again: its prefix comes from the cache of this tenant.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=BASE_MODEL, max_tokens=3, stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_completions_with_n_and_logprobs(client):
    resp = client.completions.create(model=BASE_MODEL, prompt="the model serves", max_tokens=4, n=2, seed=7,
                                     logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    for choice in resp.choices:
        assert len(choice.logprobs.tokens) == 4 and len(choice.logprobs.top_logprobs[0]) == 2
        assert "".join(choice.logprobs.tokens) == choice.text
    assert resp.usage.completion_tokens == 8


def test_streamed_completion_with_token_ids_prompt(client):
    chunks = list(client.completions.create(model=BASE_MODEL, prompt=[5, 6, 7, 8], max_tokens=5, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.prompt_tokens == 4 and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_logprobs_name_each_token(client):
    # seeded; special tokens kept in the text (a sampled <|eot_id|> is named in the logprobs either way)
    resp = client.chat.completions.create(model=BASE_MODEL, max_tokens=3, logprobs=True, top_logprobs=3, seed=7,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True, "skip_special_tokens": False})
    content = resp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == resp.choices[0].message.content


def test_bad_key_is_an_authentication_error_in_openais_shape(gateway_stack):
    bad = openai.OpenAI(base_url=gateway_stack.v1, api_key="lpx-" + "x" * 43, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401
    assert set(info.value.body) == {"message", "type", "param", "code"}
    assert info.value.body["type"] == "authentication_error"
    missing = httpx.get(gateway_stack.v1 + "/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"


def test_every_response_has_a_request_id(gateway_stack):
    auth = {"authorization": f"Bearer {gateway_stack.key_a}"}
    sane = httpx.get(gateway_stack.v1 + "/models", headers={**auth, "x-request-id": "client-abc.1"})
    assert sane.headers["x-request-id"] == "client-abc.1"
    odd = httpx.get(gateway_stack.v1 + "/models", headers={**auth, "x-request-id": "bad id\twith spaces"})
    assert odd.headers["x-request-id"].startswith("req_")
    for resp in (httpx.get(gateway_stack.v1 + "/models"), httpx.get(gateway_stack.url + "/nowhere", headers=auth),
                 httpx.get(gateway_stack.url + "/health")):
        assert resp.headers["x-request-id"]


def test_response_format_json_schema_is_guaranteed(client):
    import json

    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["age", "ok"],
              "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "ok": {"type": "boolean"}}}
    for seed in range(3):
        resp = client.chat.completions.create(
            model=BASE_MODEL, max_tokens=64, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "age?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}},
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_response_format_json_object_and_refused_schema(client):
    import json

    resp = client.chat.completions.create(
        model=BASE_MODEL, max_tokens=400, temperature=0.7, seed=1,
        messages=[{"role": "user", "content": "json please"}], response_format={"type": "json_object"},
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=BASE_MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "object", "patternPropertiez": {}}}},
        )
    assert "patternPropertiez" in info.value.body["message"]
