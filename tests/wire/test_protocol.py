"""Worker wire messages survive JSON round trips and reject malformed input."""

from __future__ import annotations

import json
import math

import pytest

from wire.errors import ErrorCode, RequestError
from wire.protocol import (
    AdapterSpec,
    GenerateDelta,
    GenerateRequest,
    Logprob,
    ProtocolError,
    SampleDelta,
    encode_message,
    parse_message,
    prefix_namespace,
)
from wire.sampling import SamplingParams


def _request(**sampling) -> GenerateRequest:
    return GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, **sampling), priority=2,
                           adapter=AdapterSpec("bot", "a" * 64, "/store/a"), cache_salt="salt", traceparent="00-x")


def test_generate_request_round_trips_with_a_typed_sampling_spec():
    req = _request(stop=["\n", "END"], choice=["yes", "no"], logprobs=2, seed=7)
    wire = json.loads(json.dumps(req.to_json()))
    back = GenerateRequest.from_json(wire)
    assert back == req and isinstance(back.sampling, SamplingParams)
    assert back.sampling.stop == ("\n", "END") and back.sampling.choice == ("yes", "no")
    assert back.prefix_namespace == prefix_namespace("salt", "a" * 64) == ("salt", "a" * 64)
    assert GenerateRequest("r", [1], SamplingParams()).prefix_namespace == ("", "")


def test_generate_request_decoding_is_strict():
    good = _request().to_json()
    bad_bodies = [
        {"request_id": "r"}, [1], {**good, "prompt_token_ids": []}, {**good, "prompt_token_ids": [1, "2"]},
        {**good, "adapter": {"name": "x"}}, {**good, "priority": "high"}, {**good, "future_field": 1},
        {**good, "sampling": {"max_tokens": 4, "bogus": 1}}, {**good, "sampling": {"top_p": 5.0}},
        {**good, "sampling": {"max_tokens": "4"}}, {**good, "sampling": {"ignore_eos": 1}},
        {**good, "sampling": {"temperature": True}}, {**good, "sampling": {"stop": [1]}},
        {**good, "sampling": [1]}, {**good, "cache_salt": 5},
    ]
    for bad in bad_bodies:
        with pytest.raises(ProtocolError):
            GenerateRequest.from_json(bad)
    with pytest.raises(ProtocolError, match="bogus"):
        GenerateRequest.from_json({**good, "sampling": {"bogus": 1}})
    with pytest.raises(ProtocolError, match="top_p"):
        GenerateRequest.from_json({**good, "sampling": {"top_p": 5.0}})
    with pytest.raises(ProtocolError, match="SamplingParams"):
        GenerateRequest("r", [1], {"max_tokens": 2})  # type: ignore[arg-type]


def test_deltas_round_trip_with_infinite_logprobs():
    delta = GenerateDelta("r1", [
        SampleDelta(0, [6], "b", [Logprob(6, -math.inf, ((6, -0.5), (7, -math.inf)))], "length"),
        SampleDelta(1, [9], "", None),
    ], num_prompt_tokens=2, num_cached_tokens=1, finished=True)
    back = parse_message(encode_message(delta))
    assert back == delta
    assert back.samples[0].logprobs[0].logprob == -math.inf and back.samples[0].logprobs[0].top[1] == (7, -math.inf)
    nan = encode_message(GenerateDelta("r", [SampleDelta(0, [1], "", [Logprob(1, math.nan)])], 1))
    assert parse_message(nan).samples[0].logprobs[0].logprob == -math.inf
    for bad in (b'{"type": "mystery"}', b"not json", b'{"type": "delta", "samples": [{}]}'):
        with pytest.raises(ProtocolError):
            parse_message(bad)


def test_errors_round_trip_with_their_code_and_unknown_codes_read_as_engine_errors():
    error = RequestError(ErrorCode.INVALID_REQUEST, "nope", param="top_p", request_id="r1")
    back = parse_message(encode_message(error))
    assert isinstance(back, RequestError)
    assert (back.code, back.message, back.param, back.request_id) == (ErrorCode.INVALID_REQUEST, "nope", "top_p", "r1")
    future = parse_message(b'{"type": "error", "code": "quantum_flux", "message": "m"}')
    assert isinstance(future, RequestError) and future.code is ErrorCode.ENGINE_ERROR
    assert RequestError(ErrorCode.ENGINE_ERROR, "x" * 5000).message == "x" * 500  # bounded on the wire


def test_each_code_has_one_status_type_and_default_message():
    expected = {"invalid_request": 400, "adapter_unavailable": 503, "worker_unavailable": 503, "engine_error": 500}
    assert {c.value: c.http_status for c in ErrorCode} == expected
    for code in ErrorCode:
        assert code.openai_type in ("invalid_request_error", "server_error") and code.default_message
        assert RequestError(code).message == code.default_message
    assert ErrorCode.WORKER_UNAVAILABLE.retry_after_s == 1 and ErrorCode.ENGINE_ERROR.retry_after_s is None
