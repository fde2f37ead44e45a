"""SamplingParams: the one sampling spec checks its types and bounds once, naming the field."""

from __future__ import annotations

import math

import pytest

from wire.sampling import MAX_N, InvalidSamplingParams, SamplingParams


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 0}, "n"), ({"n": MAX_N + 1}, "n"), ({"n": True}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"), ({"frequency_penalty": [1]}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"stop": [1]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": "42"}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"choice": []}, "choice"), ({"regex": 5}, "regex"),
    ({"json_schema": 5}, "json_schema"), ({"regex": "a+", "choice": ["a"]}, "json_schema"),
])
def test_out_of_bounds_and_wrong_types_name_the_field(kwargs, param):
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_sequences_become_tuples_and_numbers_floats():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], choice=["a", "b"], temperature=1, top_p=1)
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4) and p.choice == ("a", "b")
    assert type(p.temperature) is float and p.greedy is False
    assert SamplingParams(temperature=0).greedy and SamplingParams(stop=None).stop == ()
    assert SamplingParams(json_object=True).has_grammar and not SamplingParams().has_grammar


def test_json_codec_is_strict_and_round_trips():
    p = SamplingParams(n=2, max_tokens=9, stop=["x"], json_schema={"type": "object"}, logprobs=0, seed=3)
    assert SamplingParams.from_json(p.to_json()) == p
    assert SamplingParams.from_json({}) == SamplingParams()
    with pytest.raises(InvalidSamplingParams, match="unknown sampling field") as info:
        SamplingParams.from_json({"max_tokens": 3, "extra": {}})
    assert info.value.param == "extra"
    with pytest.raises(InvalidSamplingParams):
        SamplingParams.from_json([])
    assert not hasattr(SamplingParams(), "extra")
