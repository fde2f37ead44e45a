"""API-key authentication as a Starlette AuthenticationBackend.

`Authorization: Bearer lpx-...` → the key's tenant and scopes ("tenant" for API use, "admin" for
operators). Unknown, revoked and expired keys are 401; a suspended tenant's key is 403. Routes check
scopes with `require_scope`, so a missing or wrong key never reaches a handler.

Successful lookups are remembered for a second (gateway/auth/cache.py): most requests are authenticated
without a store read or a thread hop. A revocation or suspension through this gateway applies at once; one
made by another process (CLI, another replica) within that second.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.authentication import AuthCredentials, AuthenticationBackend, AuthenticationError, BaseUser
from starlette.concurrency import run_in_threadpool
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from gateway.auth.cache import AuthCache
from gateway.http.errors import ApiError, invalid_api_key
from gateway.store import ApiKey, Store, Tenant, TenantSuspendedError
from gateway.store.api_keys import hash_api_key

TENANT_SCOPE = "tenant"
ADMIN_SCOPE = "admin"
PUBLIC_PATHS = frozenset({"/health"})


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
