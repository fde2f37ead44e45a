"""Tool calling through the official openai client, on tiny random models with the chat templates of
Llama 3.1, Qwen2.5 and Mistral (demo/chat_styles.py), both tokenizer kinds, at temperature 1.0.

A random model has no idea what a tool is: whatever it calls comes out of the grammar alone, so every
call that validates here validates because of the constraint.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from demo.checkpoint import make_checkpoint
from tests.gateway.chat_stack import MODEL, ChatStack
from tokenization.tool_formats import FORMATS

STYLES = {"llama3.1": "llama3_json", "qwen2.5": "hermes", "mistral": "mistral"}
CASES = [(style, kind) for style in STYLES for kind in ("byte_bpe", "sentencepiece")]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "system", "content": "use the tools"}, {"role": "user", "content": "weather in Paris, and 2+2?"}]


@pytest.fixture(scope="module")
def stacks(styled_tokenizer_dirs, tmp_path_factory):
    made: dict[tuple[str, str], ChatStack] = {}

    def get(style: str, kind: str) -> ChatStack:
        if (style, kind) not in made:
            root = tmp_path_factory.mktemp(f"tools-{style}-{kind}")
            model = make_checkpoint(root / "model", "llama", tokenizer_dir=styled_tokenizer_dirs[(kind, style)])
            made[(style, kind)] = ChatStack.start(model, root / "data")
        return made[(style, kind)]

    yield get
    for stack in made.values():
        stack.stop()


def _check_calls(choice, allowed: set[str], one: bool) -> list:
    calls = choice.message.tool_calls
    finished = calls
    if choice.finish_reason == "length" and not one:
        # parallel calls are an open-ended list: a random model may go on calling until max_tokens
        # cuts it (finish "length", as OpenAI reports it); then only the last, cut call may be partial
        assert calls and len(calls) >= 2 and calls[-1].function.name in allowed, choice
        finished = calls[:-1]
    else:
        assert choice.finish_reason == "tool_calls", choice
        assert calls and (len(calls) == 1 or not one)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
    for call in finished:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize(("style", "kind"), CASES)
def test_required_and_named_calls_always_validate(stacks, style, kind):
    client = stacks(style, kind).client()
    choices = [
        ("required", None, set(SCHEMAS), False),
        ({"type": "function", "function": {"name": "add"}}, None, {"add"}, False),
        ("required", False, set(SCHEMAS), True),
        ({"type": "function", "function": {"name": "get_weather"}}, False, {"get_weather"}, True),
    ]
    for tool_choice, parallel, allowed, one in choices:
        for seed in (0, 10):  # n=10 samples draw seeds seed..seed+9: 20 seeds
            extra = {} if parallel is None else {"parallel_tool_calls": parallel}
            resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice,
                                                  n=10, seed=seed, temperature=1.0, max_tokens=400, **extra)
            assert len(resp.choices) == 10
            for choice in resp.choices:
                _check_calls(choice, allowed, one)
                assert choice.message.content is None


def _assemble(chunks) -> dict[int, dict]:
    """Stream chunks → {choice index: {"content", "calls", "finish", "ids", "names"}}, the way the openai
    client accumulates tool call deltas (by index; strings concatenated)."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None, "ids": [], "names": []})
            o["content"] += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = o["calls"].setdefault(t.index, {"id": "", "name": "", "arguments": ""})
                if t.id:
                    o["ids"].append(t.id)
                    call["id"] += t.id
                if t.function and t.function.name:
                    o["names"].append(t.function.name)
                    call["name"] += t.function.name
                if t.function and t.function.arguments:
                    call["arguments"] += t.function.arguments
            o["finish"] = c.finish_reason or o["finish"]
    return out


@pytest.mark.parametrize(("style", "kind"), CASES)
def test_streamed_calls_equal_the_non_streamed_ones(stacks, style, kind):
    client = stacks(style, kind).client()
    trigger = FORMATS[STYLES[style]].trigger
    for tool_choice in ("required", "auto"):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, n=6, seed=3,
                      temperature=1.0, max_tokens=300)
        if tool_choice == "auto":  # open the call with the trigger token, so that auto calls too
            token = stacks(style, kind).llm.tokenizer.token_id(trigger)
            kwargs["logit_bias"] = {str(token): 100}
        whole = client.chat.completions.create(**kwargs)
        streamed = _assemble(client.chat.completions.create(**kwargs, stream=True))
        for choice in whole.choices:
            got = streamed[choice.index]
            calls = choice.message.tool_calls or []
            assert got["finish"] == choice.finish_reason
            assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
                (c.function.name, c.function.arguments) for c in calls]
            assert len(got["ids"]) == len(got["names"]) == len(calls)  # id and name once per call
            assert all(i.startswith("call_") for i in got["ids"])
            assert got["content"] == (choice.message.content or "")
            assert trigger not in got["content"]


@pytest.mark.parametrize(("style", "kind"), CASES)
def test_the_openai_stream_helper_assembles_the_calls(stacks, style, kind):
    client = stacks(style, kind).client()
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        seed=1, temperature=1.0, max_tokens=300) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    _check_calls(final.choices[0], set(SCHEMAS), one=False)


@pytest.mark.parametrize(("style", "kind"), CASES)
def test_auto_with_a_forced_trigger_calls_through_the_grammar(stacks, style, kind):
    stack = stacks(style, kind)
    token = stack.llm.tokenizer.token_id(FORMATS[STYLES[style]].trigger)
    assert token is not None
    resp = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, n=5, seed=7,
                                                  temperature=1.0, max_tokens=300, logit_bias={str(token): 100})
    for choice in resp.choices:
        _check_calls(choice, set(SCHEMAS), one=False)
    # and without the push, auto is free text (a random model has no reason to call)
    plain = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=7,
                                                   max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("style", list(STYLES))
def test_auto_with_response_format_answers_or_calls(stacks, style):
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = stacks(style, "byte_bpe").client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, n=10, seed=0, temperature=1.0, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": answer}})
    for choice in resp.choices:
        if choice.message.tool_calls:
            _check_calls(choice, set(SCHEMAS), one=False)
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), answer)


@pytest.mark.parametrize(("style", "kind"), CASES)
def test_a_tool_result_turn_is_rendered_and_served(stacks, style, kind):
    client = stacks(style, kind).client()
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           seed=2, max_tokens=300)
    call = first.choices[0].message.tool_calls[0]
    follow = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    for stream in (False, True):
        resp = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, tool_choice="none",
                                              max_tokens=5, temperature=0, stream=stream)
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in resp if c.choices) is not None
        else:
            assert resp.choices[0].message.role == "assistant" and resp.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ["no"]}}]}, "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nope"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),  # refused by the worker's grammar, named the same way
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": TOOLS, "messages": [{"role": "tool", "content": "r"}]}, "messages[0].tool_call_id"),
    ({"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_invalid_tools_are_400s_in_openai_shape(stacks, body, param):
    client = stacks("qwen2.5", "byte_bpe").client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=body.pop("messages", MESSAGES), max_tokens=4, **body)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_template_without_tools_gets_the_default_format(make_model, tmp_path):
    """The demo template renders no tools: they are described in the system message, calls are hermes."""
    stack = ChatStack.start(make_model("llama"), tmp_path)
    try:
        resp = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, n=4, seed=0,
                                                      tool_choice="required", max_tokens=300)
        for choice in resp.choices:
            _check_calls(choice, set(SCHEMAS), one=False)
    finally:
        stack.stop()


def test_the_operator_picks_the_parser(styled_tokenizer_dirs, tmp_path: Path):
    model = make_checkpoint(tmp_path / "model", "llama", tokenizer_dir=styled_tokenizer_dirs[("byte_bpe", "qwen2.5")])
    stack = ChatStack.start(model, tmp_path / "data", tool_call_parser="mistral")
    try:
        resp = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, seed=0,
                                                      tool_choice="required", parallel_tool_calls=False,
                                                      max_tokens=300, n=3)
        for choice in resp.choices:
            _check_calls(choice, set(SCHEMAS), one=False)
    finally:
        stack.stop()
