"""Tool calls read back from realistic outputs of each format, whole and streamed in every split."""

from __future__ import annotations

import json
import random

import pytest

from tokenization.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenization.tool_formats import FORMATS, describe_tools, detect_tool_format, resolve_tool_calling
from tokenization.tool_parser import ContentDelta, ParsedCall, ToolCallParser, assemble, parse_tool_calls

W = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": "a \\"quoted\\" }{ brace", "list": [1, {"deep": [true, null]}], "emoji": "日本 😀"}'

# (format, model output, expected content, expected calls)
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', "",
     [("get_weather", W)]),
    ("hermes", f'Let me check both.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "search", "arguments": {NESTED}}}\n</tool_call>', "Let me check both.",
     [("get_weather", W), ("search", NESTED)]),
    ("hermes", '<think>\nweighing it\n</think>\n\n<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>\n',
     "<think>\nweighing it\n</think>", [("f", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', "", [("late", '{"x": 1}')]),
    ("hermes", 'a < b and <tool is not <tool_call', "a < b and <tool is not <tool_call", []),
    ("hermes", '<tool_call>\nnot a call\n</tool_call> so text', "<tool_call>\nnot a call\n</tool_call> so text", []),
    ("hermes", '<tool_call>\n{"name": "cut", "arguments": {"city": "Par', "", [("cut", '{"city": "Par')]),
    ("hermes", 'Text.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na', "Text.",
     [("a", "{}")]),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "ad', "", [("a", "{}")]),
    ("mistral", 'So [TOOL_CALLS] ', "So", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', "", [("get_weather", W)]),
    ("llama3_json", f' {{"name": "a", "parameters": {NESTED}}}; {{"name": "b", "parameters": {{}}}}', "",
     [("a", NESTED), ("b", "{}")]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}', "", [("get_weather", W)]),
    ("llama3_json", f'Looking it up. <|python_tag|>{{"name": "f", "parameters": {W}}}', "Looking it up.", [("f", W)]),
    ("llama3_json", 'The answer is {"name": 1} in JSON', 'The answer is {"name": 1} in JSON', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}, {{"name": "s", "arguments": {NESTED}}}]',
     "", [("get_weather", W), ("s", NESTED)]),
    ("mistral", f'Sure.[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(W)}}}]', "Sure.",
     [("get_weather", W)]),
    ("mistral", "[TOOL_CALLS] and nothing", "[TOOL_CALLS] and nothing", []),
]


def _expected(content: str, calls: list[tuple[str, str]]):
    return content, [ParsedCall(name, args) for name, args in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_outputs_parse(fmt, text, content, calls):
    out = parse_tool_calls(FORMATS[fmt], text)
    assert (out.content, out.calls) == _expected(content, calls)
    for call in out.calls:
        if call.name != "cut":
            json.loads(call.arguments)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_every_split_streams_the_same(fmt, text, content, calls):
    whole = _expected(content, calls)
    for i in range(len(text) + 1):
        parser = ToolCallParser(FORMATS[fmt])
        events = parser.feed(text[:i]) + parser.feed(text[i:]) + parser.finish()
        out = assemble(events)
        assert (out.content, out.calls) == whole, i
        # each call's name comes once, with its first event
        assert [e.index for e in events if type(e).__name__ == "CallStart"] == list(range(len(calls)))
    rng = random.Random(7)
    for _ in range(50):  # and random many-way splits
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text))))
        parser = ToolCallParser(FORMATS[fmt])
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out = assemble([e for p in pieces for e in parser.feed(p)] + parser.finish())
        assert (out.content, out.calls) == whole


@pytest.mark.parametrize("kind", ["byte_bpe", "sentencepiece"])
@pytest.mark.parametrize(("style", "fmt"), [("qwen2.5", "hermes"), ("llama3.1", "llama3_json"), ("mistral", "mistral")])
def test_token_by_token_detokenized_streams(styled_tokenizer_dirs, kind, style, fmt):
    """The pieces a worker really sends: one detokenized token at a time, markers included."""
    tok = Tokenizer(styled_tokenizer_dirs[(kind, style)])
    for _, text, _content, calls in [c for c in CASES if c[0] == fmt]:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
        parser = ToolCallParser(FORMATS[fmt])
        events = [e for i in ids for e in parser.feed(detok.add([i]))]
        events += parser.feed(detok.flush()) + parser.finish()
        out = assemble(events)
        decoded = parse_tool_calls(FORMATS[fmt], tok.decode(ids, skip_special_tokens=False))
        assert (out.content, out.calls) == (decoded.content, decoded.calls)
        assert [c.name for c in out.calls] == [name for name, _ in calls]
        trigger = FORMATS[fmt].trigger
        if calls:
            assert not any(isinstance(e, ContentDelta) and trigger in e.text for e in events)


def test_detection_from_template_markup(styled_tokenizer_dirs, tokenizer_dirs):
    for style, name in [("qwen2.5", "hermes"), ("llama3.1", "llama3_json"), ("mistral", "mistral")]:
        template = Tokenizer(styled_tokenizer_dirs[("byte_bpe", style)]).chat_template
        assert template is not None
        assert detect_tool_format(template.literal_text()).name == name
        calling = resolve_tool_calling(template.literal_text(), template.renders_tools())
        assert calling.format.name == name and calling.template_renders_tools and calling.detected
    plain = Tokenizer(tokenizer_dirs["byte_bpe"]).chat_template
    assert plain is not None and not plain.renders_tools()
    calling = resolve_tool_calling(plain.literal_text(), plain.renders_tools())
    assert calling.format.name == "hermes" and not calling.detected and not calling.template_renders_tools
    assert resolve_tool_calling(plain.literal_text(), False, override="mistral").format.name == "mistral"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        resolve_tool_calling("", True, override="nope")


def test_rendering_ids_and_descriptions():
    hermes, mistral = FORMATS["hermes"], FORMATS["mistral"]
    text = hermes.render_calls([("a", "{}"), ("b", '{"x": 1}')])
    assert text == '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    assert [c.name for c in parse_tool_calls(hermes, text).calls] == ["a", "b"]
    assert mistral.render_calls([("a", "{}")]) == '[TOOL_CALLS] [{"name": "a", "arguments": {}}]'
    assert FORMATS["llama3_json"].render_calls([("a", "{}")]) == '{"name": "a", "parameters": {}}'
    assert mistral.template_call_id("call_0123456789abcdef01234567") == "f01234567"
    short = mistral.template_call_id("x-1")
    assert len(short) == 9 and short.isalnum() and short == mistral.template_call_id("x-1")
    assert hermes.template_call_id("call_1") == "call_1"
    described = describe_tools(hermes, [{"type": "function", "function": {"name": "f"}}])
    assert '"name": "f"' in described and "<tool_call>" in described
