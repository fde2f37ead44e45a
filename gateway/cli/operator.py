"""`loraplex tenants ...` and `loraplex keys ...`: operator commands on the gateway's own store."""

from __future__ import annotations

import argparse
import json
import re
import time
from datetime import UTC, datetime

from gateway.cli.errors import CommandError
from gateway.store import AlreadyExistsError, ApiKey, NotFoundError, Store, Tenant, open_store

OPERATORS_TENANT = "operators"
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def open_cli_store(args: argparse.Namespace) -> Store:
    """Redis when --redis-url is set, else <data-dir>/store.db (created if needed)."""
    if args.redis_url:
        return open_store(args.redis_url)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    return open_store(args.data_dir / "store.db")


def find_tenant(store: Store, name_or_id: str) -> Tenant:
    tenant = store.get_tenant(name_or_id) or store.get_tenant_by_name(name_or_id)
    if tenant is None:
        raise CommandError(f"no tenant named {name_or_id!r} (see `loraplex tenants list`)")
    return tenant


def parse_duration(text: str) -> float:
    match = _DURATION.fullmatch(text.strip())
    if match is None or float(match[1]) <= 0:
        raise CommandError(f"--expires-in {text!r} is not a positive duration like 3600, 90m, 12h or 30d")
    return float(match[1]) * _UNIT_S[match[2]]


def _when(ts: float | None) -> str:
    return "-" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _key_status(key: ApiKey, now: float) -> str:
    if key.revoked_at is not None:
        return "revoked"
    return "expired" if key.is_expired(now) else "active"


def run_tenants(args: argparse.Namespace) -> int:
    with open_cli_store(args) as store:
        if args.action == "create":
            policy = None
            if args.policy is not None:
                try:
                    policy = json.loads(args.policy)
                except ValueError as e:
                    raise CommandError(f"--policy is not valid JSON: {e}") from None
            try:
                tenant = store.create_tenant(args.name, policy=policy, shared=args.shared)
            except AlreadyExistsError:
                raise CommandError(f"tenant {args.name!r} already exists") from None
            except ValueError as e:
                raise CommandError(str(e)) from None
            store.append_audit("cli", "tenant.create", tenant.id, after={"name": tenant.name})
            print(f"created tenant {tenant.name} ({tenant.id})")
            print(tenant.id)
        elif args.action == "list":
            print(f"{'ID':<22} {'NAME':<24} {'STATUS':<10} {'SHARED':<7} CREATED")
            for t in store.list_tenants():
                status = "suspended" if t.suspended else "active"
                print(f"{t.id:<22} {t.name:<24} {status:<10} {'yes' if t.shared else 'no':<7} {_when(t.created_at)}")
        elif args.action == "requests":
            print_requests(store, find_tenant(store, args.tenant), args.user, args.limit)
        else:
            tenant = find_tenant(store, args.tenant)
            now = time.time()
            today = store.day_totals(tenant.id, now)
            print(f"tenant:   {tenant.name} ({tenant.id})")
            print(f"status:   {'suspended' if tenant.suspended else 'active'}{', shared' if tenant.shared else ''}")
            print(f"created:  {_when(tenant.created_at)}")
            print(f"policy:   {json.dumps(tenant.policy.overrides(), sort_keys=True)}")
            print(f"today:    {today.requests} requests, {today.prompt_tokens} prompt + {today.completion_tokens} "
                  f"completion tokens ({today.cached_tokens} cached)")
            keys = store.list_api_keys(tenant.id)
            print(f"keys:     {len(keys)}")
            for key in keys:
                print(f"  {key.id}  {key.prefix}...  {_key_status(key, now):<8} scopes={','.join(sorted(key.scopes))}"
                      f"  expires={_when(key.expires_at)}  {key.name}")
    return 0


def print_requests(store: Store, tenant: Tenant, user: str | None, limit: int) -> None:
    """The tenant's latest request records (written by the gateway's usage flusher, about a second late)."""
    try:
        records = store.list_requests(tenant.id, user=user, limit=limit)
    except ValueError as e:
        raise CommandError(str(e)) from None
    print(f"{'CREATED':<21} {'REQUEST':<34} {'MODEL':<20} {'PROMPT':>7} {'COMPL':>6} {'FINISH':<12} {'KEY':<21} USER")
    for r in records:
        finish = ",".join(sorted({f or "-" for f in r.finish_reasons})) or "-"
        labels = r.user or "-"
        if r.metadata:
            labels += " " + json.dumps(r.metadata, sort_keys=True)
        print(f"{_when(r.created_at):<21} {r.request_id:<34} {r.model[:20]:<20} {r.prompt_tokens:>7} "
              f"{r.completion_tokens:>6} {finish[:12]:<12} {r.key_id:<21} {labels}")


def run_keys(args: argparse.Namespace) -> int:
    with open_cli_store(args) as store:
        now = time.time()
        if args.action == "create":
            if args.admin:
                tenant = store.get_tenant_by_name(OPERATORS_TENANT) or store.create_tenant(OPERATORS_TENANT)
                scopes = frozenset({"admin"})
            else:
                tenant, scopes = find_tenant(store, args.tenant), frozenset({"tenant"})
            expires_at = now + parse_duration(args.expires_in) if args.expires_in else None
            try:
                plaintext, key = store.create_api_key(tenant.id, scopes=scopes, name=args.name, expires_at=expires_at)
            except ValueError as e:
                raise CommandError(str(e)) from None
            store.append_audit("cli", "key.create", key.id, after={"tenant": tenant.id, "scopes": sorted(scopes)})
            print(f"created key {key.id} for tenant {tenant.name} (scopes: {','.join(sorted(scopes))}, "
                  f"expires: {_when(expires_at)})")
            print("This key is shown once; store it now.")
            print(plaintext)
        elif args.action == "list":
            tenant_id = find_tenant(store, args.tenant).id if args.tenant else None
            names = {t.id: t.name for t in store.list_tenants()}
            print(f"{'ID':<22} {'PREFIX':<14} {'TENANT':<20} {'STATUS':<8} {'SCOPES':<14} {'EXPIRES':<21} NAME")
            for key in store.list_api_keys(tenant_id):
                print(f"{key.id:<22} {key.prefix + '...':<14} {names.get(key.tenant_id, key.tenant_id):<20} "
                      f"{_key_status(key, now):<8} {','.join(sorted(key.scopes)):<14} {_when(key.expires_at):<21} "
                      f"{key.name}")
        else:
            try:
                key = store.revoke_api_key(args.key_id)
            except NotFoundError:
                raise CommandError(f"no key with id {args.key_id!r} (see `loraplex keys list`)") from None
            store.append_audit("cli", "key.revoke", key.id)
            print(f"revoked key {key.id} ({key.prefix}...)")
    return 0
