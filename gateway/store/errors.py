"""Errors the store raises. Bad arguments raise ValueError with a message naming the problem."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.store.models import ApiKey, Tenant


class StoreError(Exception):
    """Base class of every store-specific error."""


class NotFoundError(StoreError, LookupError):
    """A write named a tenant, key or adapter that does not exist."""

    def __init__(self, kind: str, ident: str) -> None:
        super().__init__(f"{kind} {ident!r} does not exist")
        self.kind = kind
        self.ident = ident


class AlreadyExistsError(StoreError):
    """A unique name is taken (tenant names)."""


class TenantSuspendedError(StoreError):
    """`authenticate` found a valid key whose tenant is suspended: the gateway answers 403, not 401.

    Raised rather than returned so that a caller who forgets the case fails closed.
    """

    def __init__(self, key: ApiKey, tenant: Tenant) -> None:
        super().__init__(f"tenant {tenant.name!r} is suspended")
        self.key = key
        self.tenant = tenant
