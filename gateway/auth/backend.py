"""API-key authentication as a Starlette AuthenticationBackend.

`Authorization: Bearer lpx-...` → the key's tenant and scopes ("tenant" for API use, "admin" for
operators). Unknown, revoked and expired keys are 401; a suspended tenant's key is 403. Routes check
scopes with `require_scope`, so a missing or wrong key never reaches a handler.

Successful lookups are remembered for a second (gateway/auth/backend.py): most requests are authenticated
without a store read or a thread hop. A revocation or suspension through this gateway applies at once; one
made by another process (CLI, another replica) within that second.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, BaseUser
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from gateway.http.errors import ApiError, invalid_api_key
from gateway.store import ApiKey, Authenticated, Store, Tenant, TenantSuspendedError
from gateway.store.api_keys import hash_api_key

TENANT_SCOPE = "tenant"
ADMIN_SCOPE = "admin"
PUBLIC_PATHS = frozenset({"/health", "/openapi.json"})  # the OpenAPI document: gateway/openai/openapi.py


@dataclass(frozen=True)
class TenantUser(BaseUser):
    tenant: Tenant
    key: ApiKey

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.tenant.name

    @property
    def identity(self) -> str:
        return self.key.id


class _AuthFailed(AuthenticationError):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class ApiKeyBackend(AuthenticationBackend):
    def __init__(self, store: Store, cache: AuthCache | None = None) -> None:
        self.store = store
        self.cache = cache if cache is not None else AuthCache()

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        if conn.url.path in PUBLIC_PATHS:
            return None
        header = conn.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _AuthFailed(ApiError(
                401, "You didn't provide an API key. Pass it as 'Authorization: Bearer lpx-...'.",
                code="missing_api_key"))
        token = token.strip()
        key_hash = hash_api_key(token)
        epoch = self.store.auth_epoch  # NOTE: before the lookup, so a change made meanwhile voids the entry
        found = self.cache.get(key_hash, epoch)
        if found is None:
            try:
                # NOTE: authenticate may write last_used_at, so it runs off the event loop.
                found = await run_in_threadpool(self.store.authenticate, token)
            except TenantSuspendedError as e:
                raise _AuthFailed(ApiError(403, f"Tenant '{e.tenant.name}' is suspended.",
                                           code="tenant_suspended")) from None
            if found is None:
                raise _AuthFailed(invalid_api_key())
            self.cache.put(key_hash, found, epoch)
        return AuthCredentials(sorted(found.key.scopes)), TenantUser(found.tenant, found.key)


def on_auth_error(conn: HTTPConnection, exc: Exception) -> Response:
    error = exc.error if isinstance(exc, _AuthFailed) else invalid_api_key()
    return error.response()


def require_scope(request: Request, *scopes: str) -> TenantUser:
    """The caller, if its key holds any of `scopes` (admin implies everything); else 403."""
    user = request.user
    if not isinstance(user, TenantUser):
        raise invalid_api_key()
    held = set(request.auth.scopes)
    if ADMIN_SCOPE in held or held.intersection(scopes):
        return user
    raise ApiError(403, f"This API key lacks the required scope ({' or '.join(scopes)}).",
                   code="insufficient_scope")


DEFAULT_AUTH_CACHE_TTL_S = 1.0


@dataclass(frozen=True)
class AuthCacheConfig:
    ttl_s: float = DEFAULT_AUTH_CACHE_TTL_S  # how stale a revocation or suspension may be
    max_entries: int = 10_000

    def __post_init__(self) -> None:
        if not 0 <= self.ttl_s <= 60:
            raise ValueError(f"auth cache ttl_s must be in [0, 60] seconds, got {self.ttl_s}")
        if self.max_entries < 1:
            raise ValueError(f"auth cache max_entries must be >= 1, got {self.max_entries}")


class AuthCache:
    """`AuthCache`: a short-lived memory of successful key lookups, so most requests skip the store.

    Semantics:
        key       sha256 of the presented bearer token (the plaintext is never kept), as the store hashes it.
        epoch     the store's `auth_epoch` read BEFORE the lookup that produced an entry; the store bumps
                  it after each revocation, suspension or policy change made in this process.
        put       only successful lookups (key, tenant); unknown, revoked, expired keys and suspended
                  tenants always go to the store, so a new key works at once and refusals are never stale.
        get       the cached (key, tenant) while younger than `ttl_s`, taken at the current epoch, and the
                  key not expired by then; else None (and the entry is dropped).
        bound     at most `max_entries`; when full, every entry older than ttl_s goes, then the oldest.

    Staleness: a revocation, suspension or policy change made through this gateway (admin API, the same
    Store object) applies to the next request; one made elsewhere (the CLI in another process, another
    replica) within `ttl_s` (1 s by default) — the price of answering most requests without a store read.
    `ttl_s = 0` turns the cache off. Not thread-safe: one event loop uses it.
    """

    def __init__(self, config: AuthCacheConfig | None = None, *,
                 monotonic: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.config = config or AuthCacheConfig()
        self._monotonic = monotonic
        self._wall = wall
        self._entries: dict[str, tuple[float, int, Authenticated]] = {}  # hash -> (stored at, epoch, found)

    @property
    def enabled(self) -> bool:
        return self.config.ttl_s > 0

    def get(self, key_hash: str, epoch: int) -> Authenticated | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        stored_at, stored_epoch, found = entry
        if stored_epoch != epoch or self._monotonic() - stored_at >= self.config.ttl_s \
                or not found.key.is_usable(self._wall()):
            del self._entries[key_hash]
            return None
        return found

    def put(self, key_hash: str, found: Authenticated, epoch: int) -> None:
        """Remember `found`, looked up when the store's auth_epoch was `epoch` (read before the lookup)."""
        if not self.enabled:
            return
        now = self._monotonic()
        if self._entries.pop(key_hash, None) is None and len(self._entries) >= self.config.max_entries:
            self._evict(now)
        self._entries[key_hash] = (now, epoch, found)  # at the end: entries stay in the order they were stored

    def __len__(self) -> int:
        return len(self._entries)

    def _evict(self, now: float) -> None:
        fresh = {h: e for h, e in self._entries.items() if now - e[0] < self.config.ttl_s}
        while len(fresh) >= self.config.max_entries:
            del fresh[next(iter(fresh))]  # insertion order: the oldest first
        self._entries = fresh


# The operator pages load without a key (their API calls carry the admin key).
DASHBOARD_PATH = "/admin"
STATIC_PREFIX = "/admin/static/"
METRICS_PATH = "/metrics"


def is_keyless_page(path: str, metrics_public: bool) -> bool:
    return (path in (DASHBOARD_PATH, DASHBOARD_PATH + "/") or path.startswith(STATIC_PREFIX)
            or (metrics_public and path == METRICS_PATH))


class KeylessPagesBackend(AuthenticationBackend):
    """Lets the dashboard page and assets (and a public /metrics) through when no key is presented;
    everything else, and any presented key, goes to the inner backend."""

    def __init__(self, inner: AuthenticationBackend, metrics_public: bool = False) -> None:
        self.inner = inner
        self.metrics_public = metrics_public

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        if "authorization" not in conn.headers and is_keyless_page(conn.url.path, self.metrics_public):
            return None
        return await self.inner.authenticate(conn)
