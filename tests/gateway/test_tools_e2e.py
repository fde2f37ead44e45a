"""Tool calling end to end on a live gateway with uploaded adapters: concurrent requests of one tenant on two
adapters and the base model run in one mixed batch (tools + `required` on adapter alpha, plain text on
adapter beta, a named tool with n=2 on the base), each equal to the same request served alone; then a
tool-result turn whose final answer follows `response_format`. Through the official openai client, on a
tiny random model with a Qwen2.5-style chat template (Hermes calls), byte-level BPE tokenizer.

A random model has no idea what a tool is: every call that validates here validates because of the grammar.
"""

from __future__ import annotations

import asyncio
import json
import threading

import jsonschema
import openai
import pytest

from demo.checkpoint import make_checkpoint
from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from tests.gateway.adapter_server import BASE_MODEL, LORA_ARGS, adapter_files, running_adapter_server, tar_gz
from tests.gateway.test_tools_api import MESSAGES, SCHEMAS, TOOLS
from tokenization.tool_formats import FORMATS

pytestmark = pytest.mark.slow  # a checkpoint, two peft adapters and their uploads: ~40 s on 2 cores

ANSWER = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 12},
                                           "done": {"type": "boolean"}},
          "required": ["summary", "done"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(styled_tokenizer_dirs, tmp_path_factory):
    """Tenant acme with two uploaded adapters, alpha and beta (made by peft on this checkpoint)."""
    root = tmp_path_factory.mktemp("tools-e2e")
    model = make_checkpoint(root / "model", "llama", tokenizer_dir=styled_tokenizer_dirs[("byte_bpe", "qwen2.5")])
    base = load_hf_base(model)
    # KV for the four samples at once: the tools make a prompt of about 600 tokens
    with running_adapter_server(model, root / "data", engine_options={"num_kv_blocks": 1024}) as s:
        for name, seed in (("alpha", 1), ("beta", 2)):
            adapter = make_peft_adapter(base, root / name, seed=seed, scale=0.3, **LORA_ARGS)
            answer = s.upload("acme", tar_gz(adapter_files(adapter.path)), name=name)
            assert answer.status_code == 201, answer.text
        yield s


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.v1, api_key=server.keys["acme"], max_retries=0, timeout=300)


def _check_calls(choice, allowed: set[str], one: bool) -> list[tuple[str, str]]:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (len(calls) == 1 or not one) and choice.message.content is None
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in calls]


REQUESTS = {  # each seeded, so that served alone or in the mixed batch it must sample the same tokens
    "alpha": dict(model="alpha", messages=MESSAGES, tools=TOOLS, tool_choice="required", seed=11, temperature=1.0,
                  max_tokens=300),
    "beta": dict(model="beta", messages=MESSAGES, seed=12, temperature=1.0, max_tokens=64,
                 extra_body={"ignore_eos": True}),
    "base": dict(model=BASE_MODEL, messages=MESSAGES, tools=TOOLS, n=2, seed=13, temperature=1.0, max_tokens=300,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False),
}


def _outcome(name: str, resp) -> list:
    """What each request must answer: valid calls, or plain text."""
    if name == "beta":
        choice = resp.choices[0]
        assert resp.model == "beta" and choice.finish_reason == "length"
        assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
        assert resp.usage.completion_tokens == 64
        return [choice.message.content]
    if name == "alpha":
        assert resp.model == "alpha" and len(resp.choices) == 1
        return [_check_calls(resp.choices[0], set(SCHEMAS), one=False)]
    assert len(resp.choices) == 2
    return [_check_calls(c, {"get_weather"}, one=True) for c in resp.choices]


def test_tools_adapters_and_n_in_one_mixed_batch_equal_each_served_alone(server):
    async def alone() -> dict:
        async with _client(server) as client:
            return {name: _outcome(name, await client.chat.completions.create(**r)) for name, r in REQUESTS.items()}

    served = asyncio.run(alone())  # (this also compiles the grammars: the mixed requests start at once)
    shas = tuple(sorted(server.records("acme", name)[0].sha256 for name in ("alpha", "beta")))
    seen: set[tuple[int, tuple[str, ...]]] = set()  # (running, adapters running) as the engine saw each step
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            stats = server.llm.stats()
            seen.add((stats.num_running, stats.lora_running_adapters))
            stop.wait(0.0005)

    async def mixed() -> dict:
        async with _client(server) as client:
            answers = await asyncio.gather(*(client.chat.completions.create(**r) for r in REQUESTS.values()))
        return dict(zip(REQUESTS, answers, strict=True))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        together = asyncio.run(mixed())
    finally:
        stop.set()
        watcher.join()
    assert any(running == 4 and adapters == shas for running, adapters in seen), seen  # 1 + 1 + 2 in one step
    assert {name: _outcome(name, resp) for name, resp in together.items()} == served


def test_a_tool_result_turn_answers_in_the_response_format(server):
    async def turns() -> None:
        async with _client(server) as client:
            await answer_after_the_tool_result(client)

    async def answer_after_the_tool_result(client: openai.AsyncOpenAI) -> None:
        first = await client.chat.completions.create(**REQUESTS["alpha"])
        calls = first.choices[0].message.tool_calls
        _check_calls(first.choices[0], set(SCHEMAS), one=False)
        follow = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                  *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls)]
        trigger = server.llm.tokenizer.token_id(FORMATS["hermes"].trigger)
        assert trigger is not None
        response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
        answers = []
        for stream in (False, True):
            # auto may call again or answer; with the trigger banned it answers, in the response format
            resp = await client.chat.completions.create(
                model="alpha", messages=follow, tools=TOOLS, tool_choice="auto", n=4, seed=5, temperature=1.0,
                max_tokens=200, response_format=response_format, logit_bias={str(trigger): -100}, stream=stream)
            if stream:
                texts, finish = ["", "", "", ""], [None] * 4
                async for chunk in resp:
                    for c in chunk.choices:
                        assert not c.delta.tool_calls
                        texts[c.index] += c.delta.content or ""
                        finish[c.index] = c.finish_reason or finish[c.index]
            else:
                texts = [c.message.content for c in resp.choices]
                finish = [c.finish_reason for c in resp.choices]
                assert all(c.message.tool_calls is None for c in resp.choices)
            assert finish == ["stop"] * 4
            for text in texts:
                jsonschema.validate(json.loads(text), ANSWER)
            answers.append(texts)
        assert answers[0] == answers[1]  # streamed the same as whole, for the same seed

    asyncio.run(turns())
