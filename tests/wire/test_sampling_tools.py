"""SamplingParams' tool_calls constraint and logit_bias: checked once, naming the field; JSON round trip."""

from __future__ import annotations

import json

import pytest

from wire.protocol import GenerateRequest
from wire.sampling import ConstrainedTool, InvalidSamplingParams, SamplingParams, ToolCallConstraint

TOOLS = (ConstrainedTool(0, "f", {"type": "object"}), ConstrainedTool(2, "g", {"type": "object", "properties": {}}))


def test_the_constraint_and_the_bias_travel_the_wire():
    params = SamplingParams(tool_calls=ToolCallConstraint("hermes", TOOLS, "required", False), json_object=True,
                            logit_bias={"7": 5, 3: -100}, skip_special_tokens=False)
    assert params.has_grammar and params.logit_bias == ((3, -100.0), (7, 5.0))
    request = GenerateRequest("r", [1, 2], params)
    assert GenerateRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    assert SamplingParams(logit_bias=[(1, 2)]).logit_bias == ((1, 2.0),)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tool_calls": {"format": "hermes", "tools": []}}, "tool_calls"),
    ({"tool_calls": {"format": "hermes", "tools": [{"index": 0, "name": "f", "parameters": {}}], "mode": "maybe"}},
     "tool_calls"),
    ({"tool_calls": {"tools": [{"index": 0, "name": "f", "parameters": {}}]}}, "tool_calls"),
    ({"tool_calls": "hermes"}, "tool_calls"),
    ({"tool_calls": {"format": "hermes", "tools": [{"index": 0, "name": "f", "parameters": {}}]}, "regex": "a"},
     "tool_calls"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {1: 101}}, "logit_bias"), ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"), ({"logit_bias": {i: 1 for i in range(2000)}}, "logit_bias"),
])
def test_wrong_constraints_and_biases_name_the_field(kwargs, param):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
