"""Per-tenant limits that operators set: rates, concurrency, queue size, request size, budgets, priority, weight.

Semantics:
    requests_per_minute / tokens_per_minute
        Token buckets of capacity = the per-minute limit, refilled continuously at limit / 60 per second,
        starting full (see `policies.token_bucket`). A request costs 1 request and
        `prompt_tokens + max_tokens` tokens at admission; the token charge is reconciled with the true
        total when the request ends.
    max_concurrent_requests
        Leases held at once (admitted and not yet released); leases expire if their gateway dies.
    max_queued_requests
        Waiters this tenant may have in the gateway's fair queue at once.
    max_tokens_per_request
        Upper bound on `prompt_tokens + max_tokens` of one request (the reservation). Must not exceed
        tokens_per_minute, so that every allowed request can eventually be admitted.
    daily_token_budget / monthly_token_budget
        Tokens per UTC day / UTC calendar month, None = unlimited. A request is admitted only if
        `used + reservation <= budget`; so once `used == budget` every request is refused.
    min_priority .. max_priority, default_priority
        vLLM-compatible integer priorities, lower = served first. A request asking for a priority outside
        the range is refused (`PriorityNotAllowed`, the gateway answers 400), not clamped: a silently
        clamped priority would let a client believe it got service it did not get.
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
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PriorityNotAllowed(ValueError):
    """A request asked for a priority outside its tenant's allowed range."""


class RequestTooLarge(ValueError):
    """prompt_tokens + max_tokens exceeds the tenant's max_tokens_per_request (retrying cannot help)."""


class TenantPolicy(BaseModel):
    """Limits of one tenant. Immutable; every field has a default an operator may override."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests_per_minute: int = Field(default=60, ge=1)
    tokens_per_minute: int = Field(default=100_000, ge=1)
    max_concurrent_requests: int = Field(default=8, ge=1)
    max_queued_requests: int = Field(default=32, ge=0)
    max_tokens_per_request: int = Field(default=16_384, ge=1)
    daily_token_budget: int | None = Field(default=None, ge=0)
    monthly_token_budget: int | None = Field(default=None, ge=0)
    # NOTE: 0 is left outside the default range so an operator can promote a tenant above everyone else.
    min_priority: int = Field(default=1, ge=0)
    max_priority: int = Field(default=9, ge=0)
    default_priority: int = Field(default=5, ge=0)
    fair_share_weight: float = Field(default=1.0, gt=0.0, le=1_000.0)
    max_adapters: int = Field(default=100, ge=0)
    max_adapter_bytes: int = Field(default=20 << 30, ge=0)
    share_prefix_cache: bool = False

    @model_validator(mode="after")
    def _check_consistency(self) -> TenantPolicy:
        if self.min_priority > self.max_priority:
            raise ValueError(
                f"min_priority ({self.min_priority}) must be <= max_priority ({self.max_priority})"
            )
        if not self.min_priority <= self.default_priority <= self.max_priority:
            raise ValueError(
                f"default_priority ({self.default_priority}) must lie in "
                f"[{self.min_priority}, {self.max_priority}]"
            )
        if self.max_tokens_per_request > self.tokens_per_minute:
            raise ValueError(
                f"max_tokens_per_request ({self.max_tokens_per_request}) must be <= tokens_per_minute "
                f"({self.tokens_per_minute}): a larger request could never be admitted"
            )
        return self

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

    def default_max_tokens(self, prompt_tokens: int) -> int:
        """max_tokens to use when a client sends none: whatever room the per-request cap leaves."""
        room = self.max_tokens_per_request - prompt_tokens
        if room < 1:
            raise RequestTooLarge(
                f"prompt_tokens ({prompt_tokens}) leaves no room under this tenant's "
                f"max_tokens_per_request ({self.max_tokens_per_request})"
            )
        return room

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
