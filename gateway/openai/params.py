"""OpenAI parameters that are neither sampling nor prompt: refused by name, or mapped onto loraplex's own.

Nothing is silently dropped: a parameter of OpenAI's API reference that loraplex does not serve is a 400
naming it (`unsupported_parameter`) when the request sets it; `store: true` likewise (no completion is
stored). `service_tier` maps onto the tenant's priority range ("priority": its most urgent priority,
"flex": its least urgent, "auto"/"default": its default) and is reported back as the tier used.
`metadata` is checked with OpenAI's limits (16 pairs, keys up to 64 characters, values up to 512).
"""

from __future__ import annotations

from gateway.http.errors import invalid_request
from gateway.openai.schema import ChatCompletionRequest
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
