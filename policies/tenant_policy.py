"""Per-tenant limits that operators set: rates, concurrency, queue size, request size, budgets, priority, weight.

`TenantPolicy` is the one parsed shape of a tenant's limits. The store keeps only the fields an operator
set (`overrides()`, JSON) and hands every reader a validated TenantPolicy; admission, the admin API, the
adapter registry and the prefix-cache namespace all read its typed fields. Operator edits go through
`with_changes` (a value sets a field, null restores its default), so every path refuses the same policies
with the same `InvalidPolicy` naming the field at fault.

Semantics:
    requests_per_minute / tokens_per_minute
        Token buckets of capacity = the per-minute limit, refilled continuously at limit / 60 per second,
        starting full (see `policies.quota`). A request costs 1 request and
        `prompt_tokens + max_tokens` tokens at admission; the token charge is reconciled with the true
        total when the request ends.
    max_concurrent_requests
        Leases held at once (admitted and not yet released); leases expire if their gateway dies.
    max_queued_requests
        Waiters this tenant may have in the gateway's fair queue at once.
    max_tokens_per_request
        Upper bound on `prompt_tokens + max_tokens` of one request (the reservation). Must not exceed
        tokens_per_minute, so that every allowed request can eventually be admitted. When not set it is
        16384 or tokens_per_minute, whichever is smaller.
    daily_token_budget / monthly_token_budget
        Tokens per UTC day / UTC calendar month, None = unlimited. A request is admitted only if
        `used + reservation <= budget`; so once `used == budget` every request is refused.
    min_priority .. max_priority, default_priority
        The one priority rule of loraplex: an integer, LOWER NUMBER = MORE URGENT (served first), as in
        vLLM, the engine scheduler (waiting order, and preemption of the highest number first) and the
        gateway's fair queue. A request without `priority` runs at default_priority (when not set: 5,
        moved into [min_priority, max_priority]). A request asking for a priority outside
        [min_priority, max_priority] is REFUSED (`PriorityNotAllowed`; the gateway answers 400
        `priority_not_allowed`), never clamped: a silently clamped priority would let a client believe
        it got service it did not get.
    fair_share_weight
        Deficit-round-robin weight within one priority level of the fair queue (2.0 gets twice the tokens
        of 1.0 under sustained contention).
    max_adapters / max_adapter_bytes
        Live LoRA adapter versions a tenant may keep uploaded, and their total size in bytes.
    share_prefix_cache
        Off by default: each tenant's KV cache lives in its own namespace (a server-chosen salt), so one
        tenant can neither reuse nor time another's cached prompts (CVE-2025-46570). An operator may turn
        it on for tenants whose prompts are public (a shared system prompt): all such tenants then share
        one namespace (still separate per adapter).

Values are strict JSON types: an int field takes no "5", 5.0 or true; a bool field takes no 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

DEFAULT_PRIORITY = 5  # moved into [min_priority, max_priority] when an operator narrows the range
DEFAULT_MAX_TOKENS_PER_REQUEST = 16_384  # lowered to tokens_per_minute when that is smaller


class PriorityNotAllowed(ValueError):
    """A request asked for a priority outside its tenant's allowed range."""


class RequestTooLarge(ValueError):
    """prompt_tokens + max_tokens exceeds the tenant's max_tokens_per_request (retrying cannot help)."""


class InvalidPolicy(ValueError):
    """A policy that does not validate. `field` names the field at fault ("policy" for the whole object)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid policy: {field}: {message}")
        self.field = field


def _default_priority(fields: dict[str, Any]) -> int:
    lo, hi = fields.get("min_priority", DEFAULT_PRIORITY), fields.get("max_priority", DEFAULT_PRIORITY)
    return min(max(DEFAULT_PRIORITY, lo), max(lo, hi))


def _default_max_tokens_per_request(fields: dict[str, Any]) -> int:
    return min(DEFAULT_MAX_TOKENS_PER_REQUEST, fields.get("tokens_per_minute", DEFAULT_MAX_TOKENS_PER_REQUEST))


class TenantPolicy(BaseModel):
    """Limits of one tenant. Immutable; every field has a default an operator may override.

    `model_fields_set` is the set of fields the operator set: `overrides()` is what the store keeps.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=True)

    requests_per_minute: int = Field(default=60, ge=1)
    tokens_per_minute: int = Field(default=100_000, ge=1)
    max_concurrent_requests: int = Field(default=8, ge=1)
    max_queued_requests: int = Field(default=32, ge=0)
    max_tokens_per_request: int = Field(default_factory=_default_max_tokens_per_request, ge=1)
    daily_token_budget: int | None = Field(default=None, ge=0)
    monthly_token_budget: int | None = Field(default=None, ge=0)
    # NOTE: 0 is left outside the default range so an operator can promote a tenant above everyone else.
    min_priority: int = Field(default=1, ge=0)
    max_priority: int = Field(default=9, ge=0)
    default_priority: int = Field(default_factory=_default_priority, ge=0)
    fair_share_weight: float = Field(default=1.0, gt=0.0, le=1_000.0)
    max_adapters: int = Field(default=100, ge=0)
    max_adapter_bytes: int = Field(default=20 << 30, ge=0)
    share_prefix_cache: bool = False

    # NOTE: field validators run in declaration order with the fields before them in `info.data`; the
    # fields they compare with are declared first. A field that failed is missing there (nothing to compare).
    @field_validator("max_tokens_per_request")
    @classmethod
    def _fits_the_token_rate(cls, value: int, info: ValidationInfo) -> int:
        tpm = info.data.get("tokens_per_minute")
        if tpm is not None and value > tpm:
            raise ValueError(f"max_tokens_per_request ({value}) must be <= tokens_per_minute ({tpm}): "
                             "a larger request could never be admitted")
        return value

    @field_validator("max_priority")
    @classmethod
    def _range_is_ordered(cls, value: int, info: ValidationInfo) -> int:
        lo = info.data.get("min_priority")
        if lo is not None and value < lo:
            raise ValueError(f"max_priority ({value}) must be >= min_priority ({lo})")
        return value

    @field_validator("default_priority")
    @classmethod
    def _default_in_range(cls, value: int, info: ValidationInfo) -> int:
        lo, hi = info.data.get("min_priority"), info.data.get("max_priority")
        if lo is not None and hi is not None and not lo <= value <= hi:
            raise ValueError(f"default_priority ({value}) must lie in [{lo}, {hi}]")
        return value

    @classmethod
    def parse(cls, overrides: Mapping[str, Any] | None) -> TenantPolicy:
        """The policy an operator's fields make (None: the defaults). Raises InvalidPolicy naming the first
        field at fault; this is the only parser of stored and edited policies."""
        if overrides is None:
            return cls()
        if not isinstance(overrides, Mapping):
            raise InvalidPolicy("policy", f"must be a JSON object, got {type(overrides).__name__}")
        try:
            return cls.model_validate(dict(overrides))
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            field = ".".join(str(p) for p in first["loc"]) or "policy"
            message = first["msg"].removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                message = f"unknown field; the fields are {list(cls.model_fields)}"
            raise InvalidPolicy(field, message) from None

    def overrides(self) -> dict[str, Any]:
        """The fields an operator set, as JSON values (what the store keeps and the admin API shows)."""
        return self.model_dump(mode="json", include=set(self.model_fields_set))

    def with_changes(self, patch: Mapping[str, Any]) -> TenantPolicy:
        """This policy's overrides with `patch` applied (a value sets a field, None restores its default),
        parsed again: derived defaults follow (a new max_priority moves an unset default_priority).
        Raises InvalidPolicy. Does not modify this policy."""
        if not isinstance(patch, Mapping):
            raise InvalidPolicy("policy", f"must be a JSON object, got {type(patch).__name__}")
        merged = self.overrides()
        for name, value in patch.items():
            if value is None and name in type(self).model_fields:
                merged.pop(name, None)
            else:
                merged[name] = value
        return self.parse(merged)

    def resolve_priority(self, requested: int | None) -> int:
        """The priority a request runs at: `default_priority` when None, else `requested` if allowed.

        Raises PriorityNotAllowed when `requested` is outside [min_priority, max_priority] or not an int.
        """
        if requested is None:
            return self.default_priority
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise PriorityNotAllowed(f"priority must be an integer, got {requested!r}")
        if not self.min_priority <= requested <= self.max_priority:
            raise PriorityNotAllowed(
                f"priority {requested} is outside this tenant's allowed range "
                f"[{self.min_priority}, {self.max_priority}] (lower is served first)"
            )
        return requested

    def check_request_size(self, prompt_tokens: int, max_tokens: int) -> int:
        """Validate a request's token counts; returns the reservation `prompt_tokens + max_tokens`.

        Raises ValueError on negative counts and RequestTooLarge above max_tokens_per_request.
        """
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got prompt_tokens={prompt_tokens}, max_tokens={max_tokens}"
            )
        reservation = prompt_tokens + max_tokens
        if reservation > self.max_tokens_per_request:
            raise RequestTooLarge(
                f"prompt_tokens ({prompt_tokens}) + max_tokens ({max_tokens}) = {reservation} exceeds this "
                f"tenant's max_tokens_per_request ({self.max_tokens_per_request})"
            )
        return reservation

    def scaled(self, fraction: float) -> TenantPolicy:
        """This policy with rate and concurrency limits multiplied by `fraction` (at least 1 each).

        Used by fail-open mode to split a tenant's limits across replicas. Budgets are not scaled.
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        tpm = max(1, int(self.tokens_per_minute * fraction))
        return self.model_copy(update={
            "requests_per_minute": max(1, int(self.requests_per_minute * fraction)),
            "tokens_per_minute": tpm,
            "max_concurrent_requests": max(1, int(self.max_concurrent_requests * fraction)),
            "max_tokens_per_request": min(self.max_tokens_per_request, tpm),
        })
