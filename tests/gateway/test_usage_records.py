"""Per-request usage records (`user`, `safety_identifier`, `metadata`, tokens, finish reasons): the store
contract on SQLite and a real Redis, the batched flush path, and end to end through the official openai
client, the admin API and the `loraplex` CLI."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from gateway.admission.base import FinalUsage, RequestLabels
from gateway.admission.usage import BatchedUsageReporter
from gateway.app import build_app
from gateway.cli.main import main
from gateway.state import GatewayConfig
from gateway.store import NotFoundError, RequestRecord, SqliteStore, Store, UsageTotals, open_store
from gateway.workers.client import InProcessEngineClient
from tests.gateway.conftest import BASE_MODEL, ROOMY_POLICY, ThreadedServer, serve_admission, wait_until
from worker.capabilities import WorkerCapabilities
from worker.server import WorkerService

T0 = 1_750_000_000.0
NOW = T0 + 100  # the store tests' clock


def record(tenant_id: str, n: int, *, at: float | None = None, user: str | None = None, **fields) -> RequestRecord:
    return RequestRecord(f"chatcmpl-{n}", tenant_id, "key_1", BASE_MODEL, None, T0 + n if at is None else at, 10 + n,
                         n, 0, ("stop",), "ok", user, **fields)


# ---- the store contract (both backends) ------------------------------------------------------------


def test_records_read_back_newest_first_filtered_and_paged(store: Store) -> None:
    t = store.create_tenant("acme")
    other = store.create_tenant("globex")
    labelled = record(t.id, 1, user="alice", safety_identifier="h-1", metadata={"team": "search", "run": "7"})
    labelled = replace(labelled, adapter="bot@2", finish_reasons=("tool_calls", "length"), cached_tokens=4)
    records = [labelled, record(t.id, 2, user="bob"), record(t.id, 3, user="alice"), record(t.id, 4)]
    store.record_requests(t.id, records, now=T0 + 10)
    store.record_requests(other.id, [record(other.id, 5, user="alice")], now=T0 + 10)

    assert store.list_requests(t.id, now=NOW) == records[::-1]
    assert store.list_requests(t.id, user="alice", now=NOW) == [records[2], labelled]
    assert store.list_requests(t.id, user="carol", now=NOW) == []
    assert store.list_requests(other.id, user="alice", now=NOW) == [record(other.id, 5, user="alice")]  # tenants apart
    page = store.list_requests(t.id, limit=2, now=NOW)
    assert page == [records[3], records[2]]
    assert store.list_requests(t.id, before=page[-1].created_at, limit=2, now=NOW) == [records[1], labelled]
    assert store.list_requests(t.id, since=T0 + 2, before=T0 + 4, now=NOW) == [records[2], records[1]]
    with pytest.raises(ValueError, match="limit"):
        store.list_requests(t.id, limit=0, now=NOW)


def test_rewriting_a_record_replaces_it_and_old_records_are_pruned(store: Store) -> None:
    t = store.create_tenant("acme")
    store.record_requests(t.id, [record(t.id, 1, user="alice"), record(t.id, 2, user="alice")], now=T0 + 10)
    again = replace(record(t.id, 2, user="alice"), completion_tokens=99)
    store.record_requests(t.id, [again], now=T0 + 10)  # a retried batch is not counted twice
    assert store.list_requests(t.id, now=NOW) == [again, record(t.id, 1, user="alice")]
    # a day later with a retention of 12 hours: both old records are gone, from every index
    store.request_retention_s = 12 * 3600
    store.record_requests(t.id, [record(t.id, 3, at=T0 + 86400)], now=T0 + 86400)
    assert [r.request_id for r in store.list_requests(t.id, now=T0 + 86400)] == ["chatcmpl-3"]
    assert store.list_requests(t.id, user="alice", now=T0 + 86400) == []
    assert store.list_requests(t.id, user="alice", since=0, now=T0 + 86400) == []


def test_record_writes_check_the_tenant_and_the_labels(store: Store) -> None:
    t = store.create_tenant("acme")
    with pytest.raises(NotFoundError):
        store.record_requests("ten_missing", [record("ten_missing", 1)])
    with pytest.raises(ValueError, match="belongs to tenant"):
        store.record_requests(t.id, [record("ten_other", 1)])
    for bad in ({"k" * 65: "v"}, {"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}, {"k": 1}):
        with pytest.raises(ValueError, match="metadata"):
            record(t.id, 1, metadata=bad)
    with pytest.raises(ValueError, match="safety_identifier"):
        record(t.id, 1, safety_identifier="s" * 65)
    edge = record(t.id, 1, user="u" * 256, metadata={f"{i:0>64}": "v" * 512 for i in range(16)})
    store.record_requests(t.id, [edge], now=NOW)
    assert store.list_requests(t.id, now=NOW) == [edge]


# ---- the batched flush path ----------------------------------------------------------------------


def labels(n: int, user: str | None = None) -> RequestLabels:
    return RequestLabels(f"chatcmpl-{n}", "key_1", BASE_MODEL, None, time.time() + n, user=user,
                         metadata={"n": str(n)})


def test_records_are_written_by_the_flush_not_at_report_time(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "store.db")
    tenant = store.create_tenant("acme")
    reporter = BatchedUsageReporter(store, flush_interval_s=60, max_pending_records=3)

    async def scenario() -> None:
        for n in range(5):  # the last two find no room: dropped and counted, never blocking the request
            await reporter.report(tenant, FinalUsage(10, n, 0, "ok", ("stop",)), labels(n, user="alice"))
        assert store.list_requests(tenant.id) == [] and reporter.pending_records == 3
        assert reporter.dropped_records == 2
        store.close()  # the next flush fails: everything stays pending
        await reporter.flush()
        assert reporter.pending_records == 3 and reporter.pending_requests == 5
        reporter.store = SqliteStore(tmp_path / "store.db")
        await reporter.close()

    asyncio.run(scenario())
    got = reporter.store.list_requests(tenant.id, user="alice")
    assert [(r.request_id, r.completion_tokens, r.metadata) for r in got] == [
        (f"chatcmpl-{n}", n, {"n": str(n)}) for n in (2, 1, 0)]
    assert reporter.store.usage_totals(tenant.id, 0, time.time() + 3600) == UsageTotals(5, 50, 10, 0)
    reporter.store.close()


# ---- end to end: openai client → gateway → store → admin API and CLI -------------------------------


@pytest.fixture(scope="module")
def llm(llama_dir: Path):
    engine = AsyncLLM.from_config(EngineConfig(model=str(llama_dir), num_kv_blocks=128, block_size=4, max_num_seqs=8))
    yield engine
    engine.shutdown()


@pytest.fixture()
def live(llm: AsyncLLM, store_url: str, tmp_path: Path):
    """A gateway that batches usage as `loraplex serve` does (flushing every 50 ms) into either store."""
    store = open_store(store_url)
    client = InProcessEngineClient(WorkerService(llm, BASE_MODEL, WorkerCapabilities.of_engine(llm.engine.config)))
    app = build_app(GatewayConfig(served_model_name=BASE_MODEL, adapter_root=tmp_path / "adapters"), store, client,
                    llm.tokenizer, admission=serve_admission(8, tmp_path),
                    usage=BatchedUsageReporter(store, flush_interval_s=0.05))
    tenant = store.create_tenant("acme", policy=ROOMY_POLICY)
    key, key_record = store.create_api_key(tenant.id)
    admin_key, _ = store.create_api_key(store.create_tenant("operators").id, scopes={"admin"})
    server = ThreadedServer(app).start()
    yield server.url, store, tenant, key, key_record.id, admin_key
    server.stop()
    store.close()


def test_user_safety_identifier_and_metadata_are_stored_with_usage(live, store_url: str, tmp_path: Path, capsys):
    url, store, tenant, key, key_id, admin_key = live
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=BASE_MODEL, messages=messages, max_tokens=5, seed=1, user="alice",
                                          safety_identifier="sha-alice", metadata={"team": "search", "ticket": "42"})
    stream = client.chat.completions.create(model=BASE_MODEL, messages=messages, max_tokens=3, n=2, seed=2,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True},
                                            user="alice")
    chunks = list(stream)
    streamed_usage = chunks[-1].usage
    streamed_finish = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason}
    completion = client.completions.create(model=BASE_MODEL, prompt="once upon", max_tokens=4, user="bob")
    assert wait_until(lambda: len(store.list_requests(tenant.id)) == 3), "the flusher did not write the records"

    admin = {"authorization": f"Bearer {admin_key}"}
    answer = httpx.get(f"{url}/admin/api/tenants/{tenant.name}/requests", params={"user": "alice"}, headers=admin)
    assert answer.status_code == 200, answer.text
    rows = answer.json()["requests"]
    assert [r["request_id"] for r in rows] == [chunks[0].id, chat.id]
    newest, first = rows
    assert first == {
        "request_id": chat.id, "tenant_id": tenant.id, "key_id": key_id, "model": BASE_MODEL, "adapter": None,
        "created_at": first["created_at"], "prompt_tokens": chat.usage.prompt_tokens,
        "completion_tokens": chat.usage.completion_tokens, "cached_tokens": 0,
        "finish_reasons": [chat.choices[0].finish_reason], "outcome": "ok", "user": "alice",
        "safety_identifier": "sha-alice", "metadata": {"team": "search", "ticket": "42"},
        "total_tokens": chat.usage.total_tokens}
    assert (newest["completion_tokens"], newest["finish_reasons"], newest["metadata"]) == (
        streamed_usage.completion_tokens, [streamed_finish[0], streamed_finish[1]], {})
    bob = httpx.get(f"{url}/admin/api/tenants/{tenant.id}/requests", params={"user": "bob"}, headers=admin).json()
    assert [(r["request_id"], r["completion_tokens"]) for r in bob["requests"]] == [
        (completion.id, completion.usage.completion_tokens)]
    paged = httpx.get(f"{url}/admin/api/tenants/{tenant.id}/requests", params={"limit": 2}, headers=admin).json()
    rest = httpx.get(f"{url}/admin/api/tenants/{tenant.id}/requests", headers=admin,
                     params={"before": paged["next_before"]}).json()
    assert [r["request_id"] for r in paged["requests"] + rest["requests"]] == [completion.id, newest["request_id"],
                                                                               chat.id]
    assert rest["next_before"] is None
    tenant_key = {"authorization": f"Bearer {key}"}
    assert httpx.get(f"{url}/admin/api/tenants/{tenant.id}/requests", headers=tenant_key).status_code == 403
    bad = httpx.get(f"{url}/admin/api/tenants/{tenant.id}/requests", params={"before": "soon"}, headers=admin)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "before")

    store_flag = ["--redis-url", store_url] if store_url.startswith("redis") else [
        "--data-dir", str(Path(store_url.removeprefix("sqlite://")).parent)]
    assert main(["tenants", "requests", tenant.name, "--user", "alice", *store_flag]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and chat.id in lines[2] and '"ticket": "42"' in lines[2] and key_id in lines[2]


@pytest.mark.parametrize(("body", "param"), [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"safety_identifier": "s" * 65}, "safety_identifier"),
    ({"user": "u" * 257}, "user"),
])
def test_labels_past_openais_limits_are_refused_by_name(gateway_stack, body, param):
    answer = httpx.post(gateway_stack.v1 + "/chat/completions", headers={"authorization": f"Bearer {gateway_stack.key_a}"},
                        json={"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
