"""Tools and tool_choice checked once (gateway/openai/tools/plan.py); the conversation as templates read it."""

from __future__ import annotations

import pytest

from gateway.http.errors import ApiError
from gateway.openai.tools.messages import template_messages
from gateway.openai.tools.plan import plan_tools
from gateway.openai.tools.reader import ToolCallReader
from tokenization.tool_formats import FORMATS, ToolCalling

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}, "strict": True}}


def _param(call) -> str:
    with pytest.raises(ApiError) as info:
        call()
    assert info.value.status == 400 and info.value.error_type == "invalid_request_error"
    return info.value.param


def test_tool_choice_modes():
    assert plan_tools(None, None, None) is None
    assert plan_tools(None, "none", None) is None
    auto = plan_tools([WEATHER, ADD], None, None)
    assert auto.mode == "auto" and [t.name for t in auto.allowed] == ["get_weather", "add"] and auto.parallel
    assert plan_tools([WEATHER], "none", None).mode == "none"
    required = plan_tools([WEATHER, ADD], "required", False)
    assert required.mode == "required" and not required.parallel
    named = plan_tools([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, None)
    assert named.mode == "required" and [t.name for t in named.allowed] == ["add"]
    assert [t.name for t in named.tools] == ["get_weather", "add"]  # the template still shows every tool
    assert named.allowed[0].strict is True
    assert auto.tools[0].template_json() == WEATHER


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (None, "required", "tool_choice"),
    (None, "auto", "tool_choice"),
    ([], None, "tools"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "tools[0].function.parameters"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
])
def test_invalid_tools_are_refused_by_name(tools, choice, param):
    assert _param(lambda: plan_tools(tools, choice, None)) == param


def test_a_tool_result_turn_for_a_template_with_tool_markup():
    calling = ToolCalling(FORMATS["mistral"], template_renders_tools=True, detected=True)
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "now?"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0123456789abcdef", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "sunny"}]
    out, tools = template_messages(messages, calling, plan_tools([WEATHER], None, None))
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[1]["content"] == "weather now?"
    assert out[2]["tool_calls"][0] == {"id": "789abcdef", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert out[3] == {"role": "tool", "content": "sunny", "tool_call_id": "789abcdef", "name": "get_weather"}
    assert tools == [WEATHER]
    bad = [*messages[:2], {**messages[2], "tool_calls": [{**messages[2]["tool_calls"][0],
                                                           "function": {"name": "f", "arguments": "{nope"}}]}]
    assert _param(lambda: template_messages(bad, calling, None)) == "messages[2].tool_calls[0].function.arguments"


def test_a_template_without_tool_markup_gets_them_as_text():
    calling = ToolCalling(FORMATS["hermes"], template_renders_tools=False, detected=False)
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    out, tools = template_messages(messages, calling, plan_tools([WEATHER], None, None))
    assert tools is None
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                      '{"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}


def test_the_reader_streams_fragments_the_openai_client_assembles():
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ids = iter(["call_a", "call_b"])
    reader = ToolCallReader(FORMATS["hermes"], new_id=lambda: next(ids))
    content, fragments = "", []
    for i in range(0, len(text) - 10, 7):
        c, f = reader.add(text[i : min(i + 7, len(text) - 10)])
        content, fragments = content + c, fragments + f
    c, f = reader.finish(text[len(text) - 10 :], stop_text="<|im_end|>")
    content, fragments = content + c, fragments + f
    assert content == "Checking."
    first = fragments[0]
    assert (first["index"], first["id"], first["type"], first["function"]["name"]) == (0, "call_a", "function",
                                                                                     "get_weather")
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments[1:])
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris"}'
    assert reader.calls == [{"id": "call_a", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
