"""The admin API against a live gateway: scopes on every route, tenants, policies, keys, usage, live
state, overview series and the audit log."""

from __future__ import annotations

import time

import httpx
import pytest
from starlette.routing import Route

from gateway.admin.dashboard import routes as dashboard_routes
from gateway.admin.routes import routes as admin_routes
from tests.gateway.admin_stack import AdminStack, start_admin_stack
from tests.gateway.conftest import wait_until

SHA = "ab" * 32


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    stack = start_admin_stack(llama_dir, tmp_path_factory.mktemp("admin-api"))
    yield stack
    stack.stop()


def _call(stack: AdminStack, method: str, path: str, key: str | None, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, stack.url + path, headers=headers, timeout=30, **kwargs)


def _every_admin_request(stack: AdminStack) -> list[tuple[str, str]]:
    """(method, concrete path) for every admin API route, dashboard page and asset, and /metrics."""
    _, key = stack.store.create_api_key(stack.tenant.id, name="victim")
    values = {"tenant": stack.tenant.name, "key_id": key.id, "name": "app.js"}
    out = []
    for route in [*admin_routes, *dashboard_routes]:
        assert isinstance(route, Route)
        path = route.path
        for param, value in values.items():
            path = path.replace("{" + param + "}", value)
        assert "{" not in path, f"no value for a parameter of {route.path}"
        out += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return out


def test_non_admin_keys_get_403_on_every_admin_route_and_page(stack):
    requests = _every_admin_request(stack)
    assert len(requests) >= 18
    for method, path in requests:
        body = {"json": {}} if method in ("POST", "PATCH") else {}
        resp = _call(stack, method, path, stack.tenant_key, **body)
        assert resp.status_code == 403, (method, path, resp.text)
        assert resp.json()["error"]["code"] == "insufficient_scope"
        anonymous = _call(stack, method, path, None, **body)
        keyless_page = path == "/admin" or path == "/admin/" or path.startswith("/admin/static/")
        assert anonymous.status_code == (200 if keyless_page else 401), (method, path)
    # The page itself holds no data: it asks for a key.
    page = _call(stack, "GET", "/admin", None)
    assert "admin key" in page.text.lower() and page.headers["content-type"].startswith("text/html")
    assert _call(stack, "GET", "/admin/static/../app.py", stack.admin_key).status_code == 404
    assert _call(stack, "GET", "/admin/api/me", stack.admin_key).json()["tenant"] == "operators"


def test_tenant_create_update_suspend_with_audit(stack):
    admin = stack.admin_key
    created = _call(stack, "POST", "/admin/api/tenants", admin, json={"name": "initech", "policy": {"max_priority": 4}})
    assert created.status_code == 201, created.text
    tenant_id = created.json()["id"]
    assert _call(stack, "POST", "/admin/api/tenants", admin, json={"name": "initech"}).status_code == 409
    bad_name = _call(stack, "POST", "/admin/api/tenants", admin, json={"name": "no spaces"})
    assert bad_name.status_code == 400 and "tenant name" in bad_name.json()["error"]["message"]

    updated = _call(stack, "PATCH", f"/admin/api/tenants/{tenant_id}", admin,
                    json={"policy": {"requests_per_minute": 5, "tokens_per_minute": 4000}})
    assert updated.status_code == 200, updated.text
    body = updated.json()
    assert body["policy"] == {"max_priority": 4, "requests_per_minute": 5, "tokens_per_minute": 4000}
    assert body["limits"]["requests_per_minute"] == 5 and body["limits"]["default_priority"] == 4
    reset = _call(stack, "PATCH", "/admin/api/tenants/initech", admin, json={"policy": {"tokens_per_minute": None}})
    assert reset.json()["policy"] == {"max_priority": 4, "requests_per_minute": 5}

    for patch, field in (({"requests_per_minute": 0}, "requests_per_minute"), ({"rpm": 3}, "rpm"),
                         ({"min_priority": 5}, "max_priority"), ({"share_prefix_cache": "yes"}, "share_prefix_cache")):
        refused = _call(stack, "PATCH", f"/admin/api/tenants/{tenant_id}", admin, json={"policy": patch})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "invalid_policy", refused.text
        assert error["param"] == f"policy.{field}" and field in error["message"], refused.text
    assert "min_priority (5)" in refused_message(stack, tenant_id, {"min_priority": 5})
    assert stack.store.get_tenant(tenant_id).policy.overrides() == {"max_priority": 4, "requests_per_minute": 5}
    bad_create = _call(stack, "POST", "/admin/api/tenants", admin, json={"name": "hooli", "policy": {"rpm": 3}})
    assert bad_create.status_code == 400 and bad_create.json()["error"]["param"] == "policy.rpm"
    assert stack.store.get_tenant_by_name("hooli") is None

    initech_key, _ = stack.store.create_api_key(tenant_id)
    assert _call(stack, "GET", "/v1/models", initech_key).status_code == 200
    assert _call(stack, "PATCH", "/admin/api/tenants/initech", admin, json={"suspended": True}).status_code == 200
    assert _call(stack, "GET", "/v1/models", initech_key).json()["error"]["code"] == "tenant_suspended"
    _call(stack, "PATCH", "/admin/api/tenants/initech", admin, json={"suspended": False})
    assert _call(stack, "GET", "/v1/models", initech_key).status_code == 200

    entries = _call(stack, "GET", "/admin/api/audit?limit=20", admin).json()["entries"]
    mine = [e for e in entries if e["target"] == tenant_id]
    assert [e["action"] for e in mine] == ["tenant.resume", "tenant.suspend", "tenant.policy.update",
                                          "tenant.policy.update", "tenant.create"]
    admin_key_id = stack.store.authenticate(admin).key.id
    assert all(e["actor"] == admin_key_id for e in mine)
    first_update = mine[3]
    assert first_update["before"] == {"max_priority": 4}
    assert first_update["after"] == {"max_priority": 4, "requests_per_minute": 5, "tokens_per_minute": 4000}
    assert mine[1]["before"] == {"suspended": False} and mine[1]["after"] == {"suspended": True}
    older = _call(stack, "GET", f"/admin/api/audit?limit=2&before_id={mine[1]['id']}", admin).json()["entries"]
    assert [e["id"] for e in older] == [mine[2]["id"], mine[3]["id"]]


def refused_message(stack: AdminStack, tenant_id: str, patch: dict) -> str:
    return _call(stack, "PATCH", f"/admin/api/tenants/{tenant_id}", stack.admin_key,
                 json={"policy": patch}).json()["error"]["message"]


def test_keys_are_created_once_and_revoked(stack):
    admin = stack.admin_key
    made = _call(stack, "POST", "/admin/api/tenants/acme/keys", admin, json={"name": "ci", "expires_in_s": 3600})
    assert made.status_code == 201
    plaintext, key_id = made.json()["key"], made.json()["id"]
    assert _call(stack, "GET", "/v1/models", plaintext).status_code == 200
    listed = _call(stack, "GET", "/admin/api/tenants/acme/keys", admin).json()["keys"]
    row = next(k for k in listed if k["id"] == key_id)
    assert row["status"] == "active" and row["scopes"] == ["tenant"] and "key" not in row and "hash" not in row
    assert _call(stack, "DELETE", f"/admin/api/keys/{key_id}", admin).json()["status"] == "revoked"
    assert _call(stack, "GET", "/v1/models", plaintext).status_code == 401
    assert _call(stack, "DELETE", "/admin/api/keys/key_nope", admin).status_code == 404
    actions = [(e["action"], e["target"]) for e in _call(stack, "GET", "/admin/api/audit", admin).json()["entries"]]
    assert ("key.revoke", key_id) in actions and ("key.create", key_id) in actions


def test_usage_live_state_and_overview_follow_traffic(stack):
    admin = stack.admin_key
    before = {t["name"]: t for t in _call(stack, "GET", "/admin/api/tenants", admin).json()["tenants"]}["acme"]
    for _ in range(2):
        assert stack.chat(stack.tenant_key, max_tokens=5).status_code == 200
    rows = {t["name"]: t for t in _call(stack, "GET", "/admin/api/tenants", admin).json()["tenants"]}
    acme = rows["acme"]
    assert acme["usage_today"]["requests"] == before["usage_today"]["requests"] + 2
    assert acme["usage_today"]["completion_tokens"] == before["usage_today"]["completion_tokens"] + 10
    assert acme["requests_last_minute"] >= 2 and acme["limits"]["requests_per_minute"] == 60

    for granularity in ("hour", "day"):
        usage = _call(stack, "GET", f"/admin/api/tenants/acme/usage?granularity={granularity}", admin).json()
        assert sum(r["requests"] for r in usage["rows"]) == usage["totals"]["requests"] >= 2
        assert all(r["granularity"] == granularity for r in usage["rows"])
    assert _call(stack, "GET", "/admin/api/tenants/acme/usage?granularity=week", admin).status_code == 400
    assert _call(stack, "GET", "/admin/api/tenants/acme/usage?hours=x", admin).status_code == 400
    assert _call(stack, "GET", "/admin/api/tenants/nobody/usage", admin).status_code == 404

    live = _call(stack, "GET", "/admin/api/live", admin).json()
    assert live["worker_up"] and live["queue"]["capacity"] == 8 and live["queue"]["waiting"] == 0
    worker = live["workers"][0]
    assert worker["num_kv_blocks"] == 128 and worker["prefix_query_tokens"] > 0
    assert 0.0 <= worker["prefix_hit_ratio"] <= 1.0
    assert live["admission"]["granted"] >= 2

    series = _call(stack, "GET", "/admin/api/overview", admin).json()["series"]
    assert len(series) == 120 and series[-1]["t"] >= series[0]["t"]
    assert sum(p["tokens_per_s"] for p in series) == pytest.approx(streamed_tokens(stack) / 1.0)
    assert any(p["ttft_p95_ms"] is not None and p["ttft_p95_ms"] >= p["ttft_p50_ms"] > 0 for p in series)
    assert wait_until(lambda: any(p["kv_usage"] is not None for p in
                                  _call(stack, "GET", "/admin/api/overview", admin).json()["series"]))


def streamed_tokens(stack: AdminStack) -> int:
    """Output tokens of every request so far, per the store (this module's stack served nothing else)."""
    return stack.store.usage_totals(stack.tenant.id, 0, time.time() + 3600).completion_tokens


def test_adapters_are_listed_per_tenant(stack):
    admin = stack.admin_key
    stack.store.add_adapter_version(stack.tenant.id, "support-bot", SHA, rank=8, target_modules=["q_proj"],
                                    size_bytes=1234, description="tickets")
    everyone = _call(stack, "GET", "/admin/api/adapters", admin).json()["adapters"]
    row = next(a for a in everyone if a["name"] == "support-bot")
    assert row["tenant"] == "acme" and row["ref"] == "support-bot@1" and row["resident"] is False
    assert row["rank"] == 8 and row["size_bytes"] == 1234
    own = _call(stack, "GET", "/admin/api/tenants/acme/adapters", admin).json()["adapters"]
    assert [a["ref"] for a in own] == ["support-bot@1"]
