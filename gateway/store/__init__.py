"""The gateway's persistent store: tenants, API keys, adapter records, usage and the audit log.

One interface (`Store`), two backends: SQLite (embedded default, one WAL file in the data directory)
and Redis (shared by gateway replicas). Open one with `open_store(url_or_path)`.
"""

from gateway.store.api_keys import generate_api_key, hash_api_key
from gateway.store.base import Store
from gateway.store.errors import AlreadyExistsError, NotFoundError, StoreError, TenantSuspendedError
from gateway.store.factory import open_store
from gateway.store.models import (
    AdapterRecord,
    AdapterTotals,
    ApiKey,
    AuditEntry,
    Authenticated,
    RequestRecord,
    Tenant,
    UsageRow,
    UsageTotals,
)
from gateway.store.redis_store import RedisOptions, RedisStore
from gateway.store.sqlite_connections import SqliteOptions
from gateway.store.sqlite_store import SqliteStore

__all__ = [
    "AdapterRecord",
    "AdapterTotals",
    "AlreadyExistsError",
    "ApiKey",
    "AuditEntry",
    "Authenticated",
    "NotFoundError",
    "RedisOptions",
    "RedisStore",
    "RequestRecord",
    "SqliteOptions",
    "SqliteStore",
    "Store",
    "StoreError",
    "Tenant",
    "TenantSuspendedError",
    "UsageRow",
    "UsageTotals",
    "generate_api_key",
    "hash_api_key",
    "open_store",
]
