"""OpenAI parameters that are neither sampling nor prompt: refused by name, or mapped onto loraplex's own.

Nothing is silently dropped: a parameter of OpenAI's API reference that loraplex does not serve is a 400
naming it (`unsupported_parameter`) when the request sets it; `store: true` likewise (no completion is
stored). `service_tier` maps onto the tenant's priority range ("priority": its most urgent priority,
"flex": its least urgent, "auto"/"default": its default) and is reported back as the tier used.
`metadata` is checked with OpenAI's limits (16 pairs, keys up to 64 characters, values up to 512); it is
stored with the request's usage record together with `user` (up to 256 characters) and `safety_identifier`
(up to 64, OpenAI's limit): `request_labels`.
"""

from __future__ import annotations

import time

from gateway.admission.base import RequestLabels
from gateway.http.errors import invalid_request
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest
from gateway.store import AdapterRecord
from gateway.store.models import MAX_SAFETY_IDENTIFIER_CHARS, MAX_USER_CHARS
from policies import TenantPolicy

# chat parameters of OpenAI's reference that loraplex does not serve
UNSUPPORTED_CHAT = ("audio", "prediction", "reasoning_effort", "verbosity", "web_search_options", "functions",
                    "function_call")
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def refuse_unsupported(body: ChatCompletionRequest) -> None:
    """Raise ApiError(400) for the first parameter set that loraplex cannot honour."""
    for name in UNSUPPORTED_CHAT:
        if getattr(body, name) is not None:
            hint = " Use tools and tool_choice." if name in ("functions", "function_call") else ""
            raise invalid_request(f"'{name}' is not supported by this server.{hint}", param=name,
                                  code="unsupported_parameter")
    if body.store:
        raise invalid_request("'store' is not supported: completions are not stored.", param="store",
                              code="unsupported_parameter")
    if body.modalities is not None and body.modalities != ["text"]:
        raise invalid_request("Only the 'text' modality is supported.", param="modalities",
                              code="unsupported_parameter")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS or any(
            len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()):
        raise invalid_request(f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys of at most "
                              f"{MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}.",
                              param="metadata", code="invalid_value")


def requested_priority(priority: int | None, service_tier: str | None, policy: TenantPolicy
                       ) -> tuple[int | None, str | None]:
    """(the priority to ask admission for, the tier to report back) of a request's `priority` and
    `service_tier`. Raises ApiError(400) when both are set."""
    if service_tier is None:
        return priority, None
    if priority is not None:
        raise invalid_request("Set either 'priority' or 'service_tier', not both.", param="service_tier",
                              code="invalid_value")
    if service_tier == "priority":
        return policy.min_priority, "priority"
    if service_tier == "flex":
        return policy.max_priority, "flex"
    return None, "default"


def request_labels(body: ChatCompletionRequest | CompletionRequest, request_id: str, key_id: str,
                   adapter: AdapterRecord | None) -> RequestLabels:
    """What the request's usage record keeps of it. Raises ApiError(400) naming `user` or `safety_identifier`
    when one is too long (metadata is checked by refuse_unsupported)."""
    chat = body if isinstance(body, ChatCompletionRequest) else None
    safety_identifier = chat.safety_identifier if chat is not None else None
    for name, value, most in (("user", body.user, MAX_USER_CHARS),
                              ("safety_identifier", safety_identifier, MAX_SAFETY_IDENTIFIER_CHARS)):
        if value is not None and len(value) > most:
            raise invalid_request(f"Invalid '{name}': string too long. Expected a string with maximum length {most}, "
                                  f"but got a string with length {len(value)} instead.", param=name,
                                  code="string_above_max_length")
    return RequestLabels(request_id=request_id, key_id=key_id, model=body.model,
                         adapter=None if adapter is None else adapter.ref, created_at=time.time(), user=body.user,
                         safety_identifier=safety_identifier,
                         metadata=dict(chat.metadata or {}) if chat is not None else {})
