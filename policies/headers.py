"""OpenAI-compatible rate-limit headers and error bodies.

Every response of a quota-checked request carries x-ratelimit-{limit,remaining,reset}-{requests,tokens};
reset values are durations in OpenAI's (Go's) format: "12ms", "6s", "1.5s", "1m0s", "1h2m3.004s".
Every 429 and 503 also carries retry-after (whole seconds, rounded up, at least 1) and retry-after-ms.
Durations are rounded up to the millisecond so a client that waits exactly that long is not early.
"""

from __future__ import annotations

import math

from policies.quota import Admission, RateLimitSnapshot


def format_duration(seconds: float) -> str:
    """Go/OpenAI duration string of `seconds`, rounded up to whole milliseconds."""
    if seconds < 0 or math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"duration must be a finite number >= 0, got {seconds}")
    total_ms = math.ceil(round(seconds * 1000, 6))
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    whole_s, ms = divmod(rest_ms, 1000)
    secs = f"{whole_s}.{ms:03d}".rstrip("0") if ms else str(whole_s)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(snapshot: RateLimitSnapshot) -> dict[str, str]:
    """The six x-ratelimit-* headers for a success or a refusal."""
    return {
        "x-ratelimit-limit-requests": str(snapshot.limit_requests),
        "x-ratelimit-remaining-requests": str(snapshot.remaining_requests),
        "x-ratelimit-reset-requests": format_duration(snapshot.reset_requests_s),
        "x-ratelimit-limit-tokens": str(snapshot.limit_tokens),
        "x-ratelimit-remaining-tokens": str(snapshot.remaining_tokens),
        "x-ratelimit-reset-tokens": format_duration(snapshot.reset_tokens_s),
    }


def retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """retry-after (integer seconds, >= 1, rounded up) and retry-after-ms (rounded up)."""
    if retry_after_s < 0 or math.isnan(retry_after_s) or math.isinf(retry_after_s):
        raise ValueError(f"retry_after_s must be a finite number >= 0, got {retry_after_s}")
    ms = max(1, math.ceil(round(retry_after_s * 1000, 6)))
    return {"retry-after": str(max(1, math.ceil(ms / 1000))), "retry-after-ms": str(ms)}


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def admission_headers(admission: Admission) -> dict[str, str]:
    """Headers for an admitted request's response, or for its 429 (then with retry-after)."""
    headers = rate_limit_headers(admission.snapshot)
    if not admission.granted:
        headers.update(retry_after_headers(admission.retry_after_s))
    return headers


def refusal_body(admission: Admission) -> dict:
    """The 429 body of a refused admission. type is the limit hit (OpenAI: "requests", "tokens",
    "insufficient_quota"); code is "rate_limit_exceeded" or "insufficient_quota"."""
    if admission.reason is None:
        raise ValueError("refusal_body needs a refused admission; this one was granted")
    code = admission.reason.error_code
    type_ = code if code == "insufficient_quota" else str(admission.reason)
    return error_body(admission.message, type_, code)


def unavailable_body(message: str) -> dict:
    """The 503 body (queue wait exceeded, quota store unreachable in fail-closed mode)."""
    return error_body(message, "server_error", "service_unavailable")
