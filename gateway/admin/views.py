"""What the admin API says about tenants, keys, adapters and workers (JSON shapes).

A tenant shows its policy twice: `policy`, the fields its operator set (what the store keeps and the
audit log records), and `limits`, the whole TenantPolicy the gateway enforces (defaults included) —
both from the one TenantPolicy the store parsed. `policy_error` is set when the stored policy does not
validate and the defaults are enforced instead (gateway/store/stored_policy.py).
"""

from __future__ import annotations

import time
from typing import Any

from gateway.store import AdapterRecord, ApiKey, AuditEntry, Tenant, UsageRow, UsageTotals
from wire.protocol import WorkerState


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"id": tenant.id, "name": tenant.name, "created_at": tenant.created_at, "suspended": tenant.suspended,
            "shared": tenant.shared, "policy": tenant.policy.overrides(), "policy_error": tenant.policy_error}


def tenant_detail_json(tenant: Tenant) -> dict[str, Any]:
    """The tenant with its enforced limits."""
    return {**tenant_json(tenant), "limits": tenant.policy.model_dump(mode="json")}


def tenant_row(tenant: Tenant, today: UsageTotals, requests_last_minute: int, active_keys: int) -> dict[str, Any]:
    """A tenants-table row: the tenant, its enforced limits, and usage to compare with them."""
    return {
        **tenant_detail_json(tenant),
        "usage_today": usage_totals_json(today),
        "requests_last_minute": requests_last_minute,
        "active_keys": active_keys,
    }


def usage_totals_json(totals: UsageTotals) -> dict[str, int]:
    return {"requests": totals.requests, "prompt_tokens": totals.prompt_tokens,
            "completion_tokens": totals.completion_tokens, "cached_tokens": totals.cached_tokens,
            "total_tokens": totals.total_tokens}


def usage_row_json(row: UsageRow) -> dict[str, Any]:
    return {"bucket_start": row.bucket_start, "granularity": row.granularity, "requests": row.requests,
            "prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens,
            "cached_tokens": row.cached_tokens}


def key_status(key: ApiKey, now: float | None = None) -> str:
    if key.revoked_at is not None:
        return "revoked"
    return "expired" if key.is_expired(time.time() if now is None else now) else "active"


def key_json(key: ApiKey) -> dict[str, Any]:
    """A key as listings show it: never the hash or the plaintext."""
    return {"id": key.id, "tenant_id": key.tenant_id, "prefix": key.prefix, "name": key.name,
            "scopes": sorted(key.scopes), "created_at": key.created_at, "expires_at": key.expires_at,
            "revoked_at": key.revoked_at, "last_used_at": key.last_used_at, "status": key_status(key)}


def adapter_json(record: AdapterRecord, tenant_name: str, resident: bool) -> dict[str, Any]:
    return {"tenant_id": record.tenant_id, "tenant": tenant_name, "name": record.name, "version": record.version,
            "ref": record.ref, "sha256": record.sha256, "rank": record.rank,
            "target_modules": list(record.target_modules), "size_bytes": record.size_bytes,
            "description": record.description, "created_at": record.created_at, "deleted_at": record.deleted_at,
            "shared": record.shared, "resident": resident}


def audit_json(entry: AuditEntry) -> dict[str, Any]:
    return {"id": entry.id, "at": entry.at, "actor": entry.actor, "action": entry.action, "target": entry.target,
            "before": entry.before, "after": entry.after}


def worker_json(state: WorkerState) -> dict[str, Any]:
    hit_ratio = state.prefix_hit_tokens / state.prefix_query_tokens if state.prefix_query_tokens else None
    return {**state.to_json(), "prefix_hit_ratio": hit_ratio}
