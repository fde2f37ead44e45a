"""`stop_reason` per choice, as vLLM answers it, read with the official openai client: the stop string or
stop token id that ended the choice; null when it ended by EOS, its grammar or `max_tokens`, and on every
streamed chunk but the finishing one."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.conftest import BASE_MODEL

FORCED = 300  # an ordinary token id, made the greedy choice at every step by logit_bias


@pytest.fixture(scope="module")
def client(gateway_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway_stack.v1, api_key=gateway_stack.key_a, max_retries=0, timeout=60)


def _streamed(chunks) -> tuple[str, list]:
    """(the choice-0 text of a streamed answer, each of its chunks' (finish_reason, stop_reason))."""
    text, ends = "", []
    for c in chunks:
        for choice in c.choices:
            text += getattr(choice, "text", None) or getattr(getattr(choice, "delta", None), "content", None) or ""
            ends.append((choice.finish_reason, choice.stop_reason))
    return text, ends


def test_completion_stop_string_is_the_stop_reason_streamed_and_not(client):
    base = dict(model=BASE_MODEL, prompt="the cache serves", max_tokens=16, temperature=0)
    full = client.completions.create(**base, extra_body={"ignore_eos": True})
    assert (full.choices[0].finish_reason, full.choices[0].stop_reason) == ("length", None)
    text = full.choices[0].text
    k = len(text) // 2
    stop = next(text[i:i + 2] for i in range(k, len(text) - 1) if text[i:i + 2].strip())
    cut = text[: text.index(stop)]
    resp = client.completions.create(**base, stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (cut, "stop", stop)
    streamed, ends = _streamed(client.completions.create(**base, stop=[stop], stream=True,
                                                         extra_body={"ignore_eos": True}))
    assert streamed == cut
    assert ends[-1] == ("stop", stop) and all(e == (None, None) for e in ends[:-1])


def test_stop_token_id_is_the_stop_reason_for_every_prompt_and_in_chat(client):
    extra = {"ignore_eos": True, "stop_token_ids": [FORCED]}
    resp = client.completions.create(model=BASE_MODEL, prompt=["one prompt", "another prompt"], max_tokens=8,
                                     temperature=0, logit_bias={str(FORCED): 100}, extra_body=extra)
    assert [(c.index, c.finish_reason, c.stop_reason) for c in resp.choices] == [(0, "stop", FORCED), (1, "stop", FORCED)]
    assert resp.usage.completion_tokens == 2  # each prompt stopped at its first token
    chat = dict(model=BASE_MODEL, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "hi"}],
                logit_bias={str(FORCED): 100}, extra_body=extra)
    choice = client.chat.completions.create(**chat).choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", FORCED)
    _, ends = _streamed(client.chat.completions.create(**chat, stream=True))
    assert ends[-1] == ("stop", FORCED) and all(e == (None, None) for e in ends[:-1])


def test_eos_length_and_grammar_endings_have_no_stop_reason(client, gateway_stack):
    eos = gateway_stack.llm.tokenizer.eos_token_ids[0]
    resp = client.completions.create(model=BASE_MODEL, prompt="x", max_tokens=8, temperature=0,
                                     logit_bias={str(eos): 100})
    assert (resp.choices[0].finish_reason, resp.choices[0].stop_reason) == ("stop", None)
    resp = client.chat.completions.create(model=BASE_MODEL, max_tokens=3, messages=[{"role": "user", "content": "x"}],
                                          extra_body={"ignore_eos": True})
    assert (resp.choices[0].finish_reason, resp.choices[0].stop_reason) == ("length", None)
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    chat = dict(model=BASE_MODEL, max_tokens=32, temperature=0, messages=[{"role": "user", "content": "ok?"}],
                response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": schema}})
    choice = client.chat.completions.create(**chat).choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)
    assert isinstance(json.loads(choice.message.content)["ok"], bool)
    text, ends = _streamed(client.chat.completions.create(**chat, stream=True))
    assert text == choice.message.content and ends[-1] == ("stop", None)


def test_openapi_document_describes_stop_reason(gateway_stack):
    import httpx

    doc = httpx.get(gateway_stack.url + "/openapi.json").json()
    for name in ("ChatCompletion", "Completion"):
        choice = doc["components"]["schemas"][name]["properties"]["choices"]["items"]
        assert choice["properties"]["stop_reason"] == {"type": ["string", "integer", "null"]}
