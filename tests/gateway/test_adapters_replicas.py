"""Adapters across gateway replicas: limits hold exactly under racing writers, and (slow, real processes)
an adapter uploaded through one gateway is served through another on either worker, and deleting it
frees its memory on both workers.

The race tests hit the store the way replicas do: separate store clients (one per thread, as one per
gateway process) on one real redis-server or one SQLite file, all starting at once behind a barrier.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.store import open_store
from gateway.store.base import AdapterLimitExceeded, AdapterLimits
from tests.gateway.adapter_server import adapter_files, tar_gz
from tests.gateway.conftest import ROOMY_POLICY
from tests.gateway.scale_out_stack import SECRET_HEADERS, start_gateway, start_stack, wait_gateway_sees

SHA = "ab" * 32
WRITERS = 8
LIMIT = 3


def race(store_url: str, tenant_id: str, limits: AdapterLimits, size_bytes: int = 100) -> list[str]:
    """WRITERS clients add one version each at the same moment; what each got ("ok" or the limit hit)."""
    stores = [open_store(store_url) for _ in range(WRITERS)]
    barrier = threading.Barrier(WRITERS)
    outcomes: list[str] = [""] * WRITERS

    def write(i: int) -> None:
        barrier.wait()
        try:
            stores[i].add_adapter_version(tenant_id, f"bot{i}", SHA, rank=4, target_modules=["q_proj"],
                                          size_bytes=size_bytes, limits=limits)
            outcomes[i] = "ok"
        except AdapterLimitExceeded as e:
            outcomes[i] = e.exceeded

    threads = [threading.Thread(target=write, args=(i,)) for i in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    return outcomes


def test_racing_writers_never_pass_the_count_limit(store, store_url):
    tenant = store.create_tenant("racer")
    outcomes = race(store_url, tenant.id, AdapterLimits(max_count=LIMIT, max_bytes=1 << 30))
    assert sorted(outcomes) == ["count"] * (WRITERS - LIMIT) + ["ok"] * LIMIT
    assert store.adapter_totals(tenant.id).count == LIMIT
    assert len([r for r in store.list_adapters(tenant.id) if r.deleted_at is None]) == LIMIT


def test_racing_writers_never_pass_the_byte_limit(store, store_url):
    tenant = store.create_tenant("racer")
    outcomes = race(store_url, tenant.id, AdapterLimits(max_count=100, max_bytes=250), size_bytes=100)
    assert sorted(outcomes) == ["bytes"] * (WRITERS - 2) + ["ok"] * 2
    assert store.adapter_totals(tenant.id).size_bytes == 200


def test_a_refused_write_leaves_nothing_and_deletes_make_room(store):
    tenant = store.create_tenant("racer")
    limits = AdapterLimits(max_count=1, max_bytes=1000)
    store.add_adapter_version(tenant.id, "bot", SHA, rank=4, target_modules=["q_proj"], size_bytes=10, limits=limits)
    with pytest.raises(AdapterLimitExceeded) as refused:
        store.add_adapter_version(tenant.id, "bot", SHA, rank=4, target_modules=["q_proj"], size_bytes=10,
                                  limits=limits)
    assert refused.value.exceeded == "count" and refused.value.totals.count == 1
    assert [r.version for r in store.list_adapters(tenant.id)] == [1]  # no version number was used up
    store.delete_adapter(tenant.id, "bot")
    again = store.add_adapter_version(tenant.id, "bot", SHA, rank=4, target_modules=["q_proj"], size_bytes=10,
                                      limits=limits)
    assert again.version == 2 and store.adapter_totals(tenant.id).count == 1


# ----- two gateway processes, two workers (slow) -------------------------------------------------------------


def worker_view(url: str) -> tuple[list[str], dict[str, str]]:
    """A worker's resident adapters (/state) and its adapter levels (/metrics: sha256 -> level)."""
    state = httpx.get(url + "/state", headers=SECRET_HEADERS).json()
    metrics = httpx.get(url + "/metrics", headers=SECRET_HEADERS).text
    loaded = next(f for f in text_string_to_metric_families(metrics) if f.name == "vllm:lora_adapter_loaded")
    return state["resident_adapters"], {s.labels["adapter_name"]: s.labels["level"] for s in loaded.samples}


@pytest.mark.slow
@pytest.mark.redis
def test_an_adapter_lives_on_every_replica_and_worker_until_deleted(make_model, tmp_path):
    from tests.engine.lora_peft import load_hf_base, make_peft_adapter

    model = make_model("llama")
    archive = tar_gz(adapter_files(make_peft_adapter(load_hf_base(model), tmp_path / "bot", seed=3, r=4,
                                                     lora_alpha=8, target_modules=["q_proj", "v_proj"]).path))
    stack = start_stack(model, tmp_path)
    try:
        data = tmp_path / "gateway-data"  # both gateways write adapters where every worker reads them
        gateways = [start_gateway(model, data, stack.redis_url, "round_robin") for _ in range(2)]
        stack.gateways.extend(gateways)
        for g in gateways:
            wait_gateway_sees(g, len(stack.workers))
        store = open_store(stack.redis_url)
        tenant = store.create_tenant("acme", policy={**ROOMY_POLICY, "max_adapters": LIMIT})
        key, _ = store.create_api_key(tenant.id)
        auth = {"authorization": f"Bearer {key}"}
        g1, g2 = (g.url + "/v1" for g in gateways)

        up = httpx.post(g1 + "/adapters", headers=auth, data={"name": "bot"},
                        files={"file": ("bot.tar.gz", archive, "application/gzip")}, timeout=60)
        assert up.status_code == 201, up.text
        sha = up.json()["sha256"]
        # Through the other gateway, at once; round robin over two workers sends one request to each.
        for _ in stack.workers:
            done = httpx.post(g2 + "/completions", headers=auth, timeout=60,
                              json={"model": "bot", "prompt": [5, 6, 7, 8], "max_tokens": 2, "temperature": 0})
            assert done.status_code == 200, done.text
        for w in stack.workers:
            resident, levels = worker_view(w.url)
            assert sha in resident and levels.get(sha) == "gpu", (w.url, resident, levels)

        gone = httpx.delete(g1 + "/adapters/bot", headers=auth, timeout=30)
        assert gone.status_code == 200, gone.text
        for w in stack.workers:  # every worker was told: slot and host memory freed
            resident, levels = worker_view(w.url)
            assert sha not in resident and sha not in levels, (w.url, resident, levels)
        refused = httpx.post(g2 + "/completions", headers=auth, timeout=60,
                             json={"model": "bot", "prompt": [5, 6, 7, 8], "max_tokens": 2})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text

        # Uploads racing through both gateways against max_adapters never store one more (two at a time
        # per gateway: one tenant's uploads in flight per gateway are limited to that).
        async def upload_all() -> list[int]:
            gates = [asyncio.Semaphore(2), asyncio.Semaphore(2)]
            async with httpx.AsyncClient(timeout=120) as client:
                async def one(i: int) -> int:
                    async with gates[i % 2]:
                        resp = await client.post((g1, g2)[i % 2] + "/adapters", headers=auth, data={"name": f"v{i}"},
                                                 files={"file": ("a.tar.gz", archive, "application/gzip")})
                    return resp.status_code

                return await asyncio.gather(*(one(i) for i in range(2 * LIMIT + 2)))

        codes = asyncio.run(upload_all())
        assert sorted(codes) == [201] * LIMIT + [403] * (LIMIT + 2), codes
        assert store.adapter_totals(tenant.id).count == LIMIT
        store.close()
    finally:
        stack.stop()
