"""A refused tool-call grammar names the body field at fault through the error's `param`, never by reading
its message: the tool whose parameters were refused, or the request's tools when the refusal is the whole
grammar's."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from grammar import GrammarError
from grammar.normalize import NormalizedSchema, NormalizeReport
from grammar.tool_calls import ToolCallsSpec, normalize_tool_calls
from wire.sampling import ConstrainedTool, InvalidSamplingParams, ToolCallConstraint

GOOD = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
DANGLING = {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64, block_size=4, dtype="float32"))
    yield eng
    eng.shutdown()


def _params(*schemas: dict, answer: dict | None = None) -> SamplingParams:
    tools = tuple(ConstrainedTool(i, f"tool_{i}", s) for i, s in enumerate(schemas))
    return SamplingParams(max_tokens=20, skip_special_tokens=False, json_schema=answer,
                          tool_calls=ToolCallConstraint("hermes", tools, "auto" if answer else "required", True))


def test_the_refused_tool_is_named_by_param(engine):
    with pytest.raises(InvalidSamplingParams) as err:
        engine.add_request("bad-tool", [5, 6, 7], _params(GOOD, DANGLING))
    assert err.value.param == "tools[1].function.parameters"
    with pytest.raises(InvalidSamplingParams) as err:
        engine.add_request("bad-answer", [5, 6, 7], _params(GOOD, answer=DANGLING))
    assert err.value.param == "response_format"
    assert not engine.has_unfinished_requests()


def test_a_refusal_of_the_whole_tool_grammar_names_the_tools(engine):
    huge = {"type": "object", "properties": {"w": {"enum": [f"word{i:07d}" for i in range(200_000)]}}}
    with pytest.raises(InvalidSamplingParams, match="too large") as err:
        engine.add_request("too-large", [5, 6, 7], _params(GOOD, huge))
    assert err.value.param == "tools"  # no single tool to blame, and not response_format
    assert not engine.has_unfinished_requests()


def test_the_grammar_error_carries_the_param_whatever_its_message():
    spec = ToolCallsSpec.from_json({"format": "hermes", "mode": "required", "parallel": True,
                                    "tools": [[3, "a", GOOD], [5, "b", DANGLING]]})

    def refuse_dangling(schema: dict):
        if schema == DANGLING:
            raise GrammarError("no")  # a message that names nothing
        return NormalizedSchema(schema, NormalizeReport())

    with pytest.raises(GrammarError) as err:
        normalize_tool_calls(spec, refuse_dangling)
    assert err.value.param == "tools[5].function.parameters"  # the request's index, not the position
