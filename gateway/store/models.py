"""Records the store keeps, and the rules their fields obey.

Times are POSIX seconds (float, UTC). Records are frozen snapshots: the store returns fresh objects on
every read, so nothing a caller holds changes what is stored. A tenant's policy is an immutable, validated
`policies.TenantPolicy` (gateway/store/stored_policy.py says how it is kept).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from policies.tenant_policy import TenantPolicy

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SCOPE_PATTERN = re.compile(r"[a-z][a-z0-9:_-]{0,63}")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")

Granularity = Literal["hour", "day"]


def check_name(kind: str, name: str) -> str:
    """Tenant and adapter names: 1-64 of [A-Za-z0-9._-], starting alphanumeric (no '@', ':' or '/')."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"{kind} name {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_sha256(sha256: str) -> str:
    if not isinstance(sha256, str) or not SHA256_PATTERN.fullmatch(sha256):
        raise ValueError(f"sha256 {sha256!r} is not 64 lowercase hex digits")
    return sha256


def check_scopes(scopes: frozenset[str] | set[str] | tuple[str, ...] | list[str]) -> frozenset[str]:
    """Scopes are opaque to the store; the gateway gives them meaning ("tenant", "admin", ...)."""
    if isinstance(scopes, str):
        raise ValueError(f"scopes must be a collection of strings, not the string {scopes!r}")
    out = frozenset(scopes)
    if not out:
        raise ValueError("an API key needs at least one scope")
    for scope in out:
        if not isinstance(scope, str) or not SCOPE_PATTERN.fullmatch(scope):
            raise ValueError(f"scope {scope!r} is invalid: use lowercase letters, digits, ':', '_' or '-'")
    return out


def check_time(what: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be finite POSIX seconds, got {value!r}")
    return float(value)


def check_count(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


def json_text(what: str, value: Any) -> str:
    """Canonical JSON text of `value`; ValueError naming `what` if it is not JSON-serializable."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serializable: {exc}") from None


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    created_at: float
    suspended: bool
    policy: TenantPolicy  # validated; the defaults when the stored one is invalid (then see policy_error)
    cache_salt: str  # chosen by the server at creation, never by a client; namespaces the KV cache
    shared: bool = False
    policy_error: str | None = None  # why the stored policy is not enforced, when it does not validate


@dataclass(frozen=True)
class ApiKey:
    id: str
    tenant_id: str
    prefix: str  # first characters of the plaintext, safe to show in listings
    hash: str  # sha256 hex of the plaintext; the plaintext itself is never stored
    scopes: frozenset[str]
    created_at: float
    name: str = ""
    expires_at: float | None = None
    revoked_at: float | None = None
    last_used_at: float | None = None

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def is_usable(self, now: float) -> bool:
        return self.revoked_at is None and not self.is_expired(now)


class Authenticated(NamedTuple):
    """What `Store.authenticate` returns for a usable key of an active tenant."""

    key: ApiKey
    tenant: Tenant


@dataclass(frozen=True)
class AdapterRecord:
    tenant_id: str  # owner
    name: str
    version: int  # 1, 2, 3... per (tenant, name); never reused, even after a delete
    sha256: str  # content address of the adapter file
    rank: int
    target_modules: tuple[str, ...]
    size_bytes: int
    description: str
    created_at: float
    deleted_at: float | None = None
    shared: bool = False  # visible to every tenant, not only the owner

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class AdapterTotals:
    """Live (not deleted) adapter versions of one tenant, for quotas."""

    count: int
    size_bytes: int


@dataclass(frozen=True)
class UsageTotals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (a subset of prompt_tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UsageRow:
    tenant_id: str
    bucket_start: int  # POSIX seconds of the UTC hour or day the row covers
    granularity: Granularity
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class AuditEntry:
    id: int  # increasing; newer entries have larger ids
    at: float
    actor: str  # API key id, or "cli"
    action: str  # e.g. "tenant.policy.update"
    target: str  # e.g. a tenant id or "tenant_id/adapter_name"
    before: Any = field(default=None, hash=False)  # JSON value
    after: Any = field(default=None, hash=False)  # JSON value


MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
MAX_USER_CHARS, MAX_SAFETY_IDENTIFIER_CHARS = 256, 64


@dataclass(frozen=True)
class RequestRecord:
    """One served request as operators read it back: who sent it, the labels it carried, what it cost.

    Written in batches by the usage flusher (gateway/admission/usage.py), kept for a retention period.
    """

    request_id: str
    tenant_id: str
    key_id: str
    model: str  # the name the request asked for and the response echoed
    adapter: str | None  # the adapter version served (name@version); None: the base model
    created_at: float  # when the gateway admitted it
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reasons: tuple[str | None, ...]  # one per choice, as answered ("tool_calls", "length"...); None: none
    outcome: str  # "ok" | "error" | "disconnected"
    user: str | None = None  # OpenAI's `user`: the tenant's end user
    safety_identifier: str | None = None
    metadata: dict[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for what, value in (("request_id", self.request_id), ("tenant_id", self.tenant_id), ("key_id", self.key_id),
                            ("model", self.model)):
            if not isinstance(value, str) or not value or len(value) > 200:
                raise ValueError(f"{what} must be a non-empty string of at most 200 characters")
        check_time("created_at", self.created_at)
        for what, count in (("prompt_tokens", self.prompt_tokens), ("completion_tokens", self.completion_tokens),
                            ("cached_tokens", self.cached_tokens)):
            check_count(what, count)
        check_label("user", self.user, MAX_USER_CHARS)
        check_label("safety_identifier", self.safety_identifier, MAX_SAFETY_IDENTIFIER_CHARS)
        check_metadata(self.metadata)


def check_label(what: str, value: str | None, max_chars: int) -> str | None:
    if value is not None and (not isinstance(value, str) or len(value) > max_chars):
        raise ValueError(f"{what} must be a string of at most {max_chars} characters")
    return value


def check_metadata(metadata: Any) -> dict[str, str]:
    """OpenAI's metadata limits: at most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS
            and len(v) <= MAX_METADATA_VALUE_CHARS for k, v in metadata.items()):
        raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs of strings, keys of at most "
                         f"{MAX_METADATA_KEY_CHARS} characters and values of at most {MAX_METADATA_VALUE_CHARS}")
    return metadata
