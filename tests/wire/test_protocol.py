"""Worker wire messages survive JSON round trips and reject malformed input."""

from __future__ import annotations

import math

import pytest

from engine.outputs import CompletionOutput, Logprob, RequestOutput
from wire.protocol import (
    AdapterSpec,
    GenerateError,
    GenerateRequest,
    ProtocolError,
    encode_message,
    parse_message,
)
from worker.server import delta_from_output


def test_generate_request_round_trip_and_validation():
    req = GenerateRequest("r1", [1, 2, 3], {"max_tokens": 4}, priority=2,
                          adapter=AdapterSpec("bot", "a" * 64, "/store/a"), cache_salt="salt", traceparent="00-x")
    assert GenerateRequest.from_json(req.to_json()) == req
    assert GenerateRequest.from_json({**req.to_json(), "future_field": 1}) == req
    for bad in ({"request_id": "r"}, {**req.to_json(), "prompt_token_ids": []},
                {**req.to_json(), "prompt_token_ids": [1, "2"]}, {**req.to_json(), "adapter": {"name": "x"}},
                {**req.to_json(), "priority": "high"}, [1]):
        with pytest.raises(ProtocolError):
            GenerateRequest.from_json(bad)


def test_deltas_round_trip_with_infinite_logprobs():
    out = RequestOutput("r1", None, [1, 2], [CompletionOutput(
        index=0, text="ab", token_ids=[5, 6], finish_reason="length",
        delta_text="b", delta_token_ids=[6], delta_logprobs=[Logprob(6, -math.inf, [(6, -0.5), (7, -math.inf)])],
    )], finished=True, num_cached_tokens=1)
    delta = delta_from_output(out, with_logprobs=True)
    back = parse_message(encode_message(delta))
    assert back.samples[0].token_ids == [6] and back.finished and back.num_cached_tokens == 1
    assert back.samples[0].logprobs[0].logprob == -math.inf and back.samples[0].logprobs[0].top[1] == (7, -math.inf)
    assert parse_message(encode_message(GenerateError("r1", "invalid_request", "nope"))).message == "nope"
    with pytest.raises(ProtocolError):
        parse_message(b'{"type": "mystery"}')
    with pytest.raises(ProtocolError):
        parse_message(b"not json")
