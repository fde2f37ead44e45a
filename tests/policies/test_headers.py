"""Rate-limit headers, retry-after and OpenAI error bodies from real admissions."""

from __future__ import annotations

import asyncio

import pytest

from policies.headers import (
    admission_headers,
    format_duration,
    refusal_body,
    retry_after_headers,
    unavailable_body,
)
from policies.memory_quota import MemoryQuotaBackend
from policies.tenant_policy import TenantPolicy

T0 = 1_750_000_000.0


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (0.012, "12ms"), (0.0121, "13ms"), (0.999, "999ms"), (1, "1s"), (6, "6s"), (1.5, "1.5s"),
    (59.999, "59.999s"), (60, "1m0s"), (90.25, "1m30.25s"), (3600, "1h0m0s"), (3723.004, "1h2m3.004s"),
])
def test_format_duration_like_openai(seconds, text):
    assert format_duration(seconds) == text


def test_retry_after_rounds_up_and_is_at_least_one_second():
    assert retry_after_headers(0.2) == {"retry-after": "1", "retry-after-ms": "200"}
    assert retry_after_headers(2.0001) == {"retry-after": "3", "retry-after-ms": "2001"}
    with pytest.raises(ValueError, match="retry_after_s"):
        retry_after_headers(-1)


def test_headers_consistent_on_success_and_on_429():
    async def scenario():
        backend = MemoryQuotaBackend()
        policy = TenantPolicy(requests_per_minute=2, tokens_per_minute=600, max_tokens_per_request=600)
        first = await backend.admit("t", policy, 100, 200, T0)
        second = await backend.admit("t", policy, 100, 200, T0)
        third = await backend.admit("t", policy, 1, 1, T0 + 1)
        return first, second, third

    first, second, third = asyncio.run(scenario())
    assert admission_headers(first) == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s", "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "300", "x-ratelimit-reset-tokens": "30s",
    }
    assert admission_headers(second)["x-ratelimit-remaining-tokens"] == "0"
    assert admission_headers(second)["x-ratelimit-reset-tokens"] == "1m0s"
    refused = admission_headers(third)
    assert refused["x-ratelimit-remaining-requests"] == "0"
    assert refused["x-ratelimit-reset-requests"] == "59s"  # one request refills in 30 s, both in 59 s
    assert (refused["retry-after"], refused["retry-after-ms"]) == ("29", "29000")
    body = refusal_body(third)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
    assert "29.000s" in body["error"]["message"]
    with pytest.raises(ValueError, match="granted"):
        refusal_body(first)


def test_budget_refusal_body_is_insufficient_quota():
    async def scenario():
        backend = MemoryQuotaBackend()
        policy = TenantPolicy(monthly_token_budget=10)
        return await backend.admit("t", policy, 11, 0, T0)

    body = refusal_body(asyncio.run(scenario()))
    assert body["error"]["code"] == "insufficient_quota" and body["error"]["type"] == "insufficient_quota"
    assert unavailable_body("down")["error"] == {
        "message": "down", "type": "server_error", "param": None, "code": "service_unavailable"}
