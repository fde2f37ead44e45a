"""Tenants see and use only their own (and shared) adapters; revoked, expired and suspended keys fail."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.gateway.conftest import BASE_MODEL

SHA_A = "a" * 64
SHA_SHARED = "5" * 64


def _get(stack, path, key):
    return httpx.get(stack.v1 + path, headers={"authorization": f"Bearer {key}"}, timeout=30)


def _chat(stack, key, model):
    return httpx.post(stack.v1 + "/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


@pytest.fixture(scope="module")
def adapters(gateway_stack):
    store = gateway_stack.store
    store.add_adapter_version(gateway_stack.tenant_a, "support-bot", SHA_A, rank=8, target_modules=["q_proj"],
                              size_bytes=100)
    store.add_adapter_version(gateway_stack.tenant_a, "support-bot", SHA_A.replace("a", "b"), rank=8,
                              target_modules=["q_proj"], size_bytes=100)
    operator = store.create_tenant("house")
    store.add_adapter_version(operator.id, "house-style", SHA_SHARED, rank=4, target_modules=["v_proj"],
                              size_bytes=10, shared=True)
    return store


def test_owner_sees_its_adapters_with_parent_base(gateway_stack, adapters):
    data = _get(gateway_stack, "/models", gateway_stack.key_a).json()["data"]
    ids = {m["id"]: m for m in data}
    assert {"support-bot", "support-bot@1", "support-bot@2", "house-style", BASE_MODEL} <= set(ids)
    assert ids["support-bot"]["parent"] == BASE_MODEL and ids[BASE_MODEL]["parent"] is None
    assert _get(gateway_stack, "/models/support-bot@2", gateway_stack.key_a).json()["id"] == "support-bot@2"


def test_other_tenant_cannot_see_or_use_it(gateway_stack, adapters):
    ids = {m["id"] for m in _get(gateway_stack, "/models", gateway_stack.key_b).json()["data"]}
    assert ids == {BASE_MODEL, "house-style", "house-style@1"}
    unknown = _chat(gateway_stack, gateway_stack.key_b, "never-existed")
    for model in ("support-bot", "support-bot@1"):
        resp = _chat(gateway_stack, gateway_stack.key_b, model)
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "model_not_found" == unknown.json()["error"]["code"]
        assert resp.json()["error"]["message"].replace(model, "X") == unknown.json()["error"]["message"].replace(
            "never-existed", "X")
        assert _get(gateway_stack, f"/models/{model}", gateway_stack.key_b).status_code == 404


def test_adapter_requests_are_never_served_by_the_base_model(gateway_stack, adapters):
    """The adapter's files are not in storage here, so the worker must refuse, not fall back to the base."""
    for key, model in ((gateway_stack.key_a, "support-bot"), (gateway_stack.key_b, "house-style")):
        resp = _chat(gateway_stack, key, model)
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "adapter_unavailable"


def test_revoked_and_expired_keys_get_401_and_suspended_403(gateway_stack):
    store = gateway_stack.store
    tenant = store.create_tenant("initech")
    revoked, revoked_key = store.create_api_key(tenant.id)
    expired, _ = store.create_api_key(tenant.id, expires_at=time.time() - 1)
    live, _ = store.create_api_key(tenant.id, expires_at=time.time() + 3600)
    assert _get(gateway_stack, "/models", revoked).status_code == 200
    store.revoke_api_key(revoked_key.id)
    for key in (revoked, expired):
        resp = _get(gateway_stack, "/models", key)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert _get(gateway_stack, "/models", live).status_code == 200
    store.suspend_tenant(tenant.id)
    resp = _get(gateway_stack, "/models", live)
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "tenant_suspended"


def test_priority_outside_the_tenants_range_is_refused_never_clamped(gateway_stack):
    """The one priority rule (policies.TenantPolicy): lower is served first, absent means default_priority,
    and outside [min_priority, max_priority] is a 400 (this test once expected clamping, which the
    admission serve runs never did)."""
    store = gateway_stack.store
    tenant = store.create_tenant("prio", policy={"min_priority": 3, "max_priority": 6, "default_priority": 4})
    key, _ = store.create_api_key(tenant.id)

    def complete(**extra):
        return httpx.post(gateway_stack.v1 + "/completions", headers={"authorization": f"Bearer {key}"},
                          timeout=30, json={"model": BASE_MODEL, "prompt": "hi", "max_tokens": 2, **extra})

    for allowed in ({}, {"priority": 3}, {"priority": 6}):
        assert complete(**allowed).status_code == 200
    for refused in (-5, 0, 2, 7, 99):
        resp = complete(priority=refused)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "priority_not_allowed"
        assert resp.json()["error"]["param"] == "priority"


def _cached_tokens(stack, key, text):
    resp = httpx.post(stack.v1 + "/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": BASE_MODEL, "max_tokens": 1, "prompt": text})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_never_share_kv_unless_an_operator_makes_both_public(gateway_stack):
    store = gateway_stack.store
    prompt = "the shared system prompt of a public assistant " * 6
    assert _cached_tokens(gateway_stack, gateway_stack.key_a, prompt) == 0
    assert _cached_tokens(gateway_stack, gateway_stack.key_a, prompt) > 0  # A's own cache works
    assert _cached_tokens(gateway_stack, gateway_stack.key_b, prompt) == 0  # B cannot reuse (or time) A's KV
    try:
        for tenant in (gateway_stack.tenant_a, gateway_stack.tenant_b):
            store.update_policy(tenant, store.get_tenant(tenant).policy.with_changes({"share_prefix_cache": True}))
        public = prompt + "(public)"
        assert _cached_tokens(gateway_stack, gateway_stack.key_a, public) == 0
        assert _cached_tokens(gateway_stack, gateway_stack.key_b, public) > 0
    finally:
        for tenant in (gateway_stack.tenant_a, gateway_stack.tenant_b):
            store.update_policy(tenant, store.get_tenant(tenant).policy.with_changes({"share_prefix_cache": None}))
