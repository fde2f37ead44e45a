"""What the admin API says about tenants, keys, adapters and workers (JSON shapes), and how it checks a
policy edit before storing it.

A tenant's stored policy holds only the fields an operator set; `effective_policy` fills the rest the
way the gateway's admission does (gateway.admission.quota.TenantPolicies), so the dashboard shows the
limits that are actually enforced.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from pydantic import ValidationError

from gateway.admission.quota import TenantPolicies
from gateway.store import AdapterRecord, ApiKey, AuditEntry, Tenant, UsageRow, UsageTotals
from policies import TenantPolicy
from wire.protocol import WorkerState

POLICY_FIELDS = tuple(TenantPolicy.model_fields)


class PolicyError(ValueError):
    """A policy edit the gateway would not enforce as written (the message names the field)."""


def merge_policy(stored: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`stored` with `patch` applied: a value sets a field, null clears it back to the default."""
    unknown = sorted(set(patch) - set(POLICY_FIELDS))
    if unknown:
        raise PolicyError(f"unknown policy field(s) {unknown}; known fields: {list(POLICY_FIELDS)}")
    merged = dict(stored)
    for name, value in patch.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


def effective_policy(tenant: Tenant, policy: dict[str, Any] | None = None) -> TenantPolicy:
    """The limits the gateway enforces for `tenant` (with `policy` instead of its stored one, if given).

    Raises PolicyError when that policy is invalid (the gateway would fall back to the defaults)."""
    candidate = tenant if policy is None else replace(tenant, policy=policy)
    policies = TenantPolicies()
    result = policies.policy_for(candidate)
    if result is not policies.default:
        return result
    try:  # invalid: name the first problem, as strict validation over the defaults sees it
        TenantPolicy.model_validate({**TenantPolicy().model_dump(), **candidate.policy})
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "policy"
        raise PolicyError(f"invalid policy: {where}: {first['msg']}") from None
    return result


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return {"id": tenant.id, "name": tenant.name, "created_at": tenant.created_at, "suspended": tenant.suspended,
            "shared": tenant.shared, "policy": tenant.policy}


def tenant_row(tenant: Tenant, limits: TenantPolicy, today: UsageTotals, requests_last_minute: int,
               active_keys: int) -> dict[str, Any]:
    """A tenants-table row: the tenant, its enforced limits, and usage to compare with them."""
    return {
        **tenant_json(tenant),
        "limits": limits.model_dump(),
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
