"""AdapterRegistry without HTTP: failures after the file is stored, shared content, limits under concurrency."""

from __future__ import annotations

import dataclasses
import shutil
import threading

import pytest

from engine.config import ModelConfig
from gateway.adapters.registry import AdapterRegistry, AdapterUploadConfig
from gateway.http.errors import ApiError
from gateway.store import NotFoundError, SqliteStore
from policies import InvalidPolicy
from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from tests.gateway.adapter_server import LORA_ARGS, adapter_files, tar_gz


@pytest.fixture(scope="module")
def archive(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    path = root / "ok.tar.gz"
    path.write_bytes(tar_gz(adapter_files(make_peft_adapter(load_hf_base(llama_dir), root / "ok", 1, **LORA_ARGS).path)))
    return path


@pytest.fixture()
def registry(llama_dir, tmp_path):
    store = SqliteStore(tmp_path / "store.db")
    yield AdapterRegistry(store, tmp_path / "adapters",
                          AdapterUploadConfig(ModelConfig.from_pretrained(llama_dir), max_lora_rank=8))
    store.close()


def _ingest(registry, tenant, name, archive):
    work = registry.new_work_dir()
    try:
        return registry.ingest(tenant, name, "", archive, work)
    finally:
        shutil.rmtree(work)


def test_record_failure_after_storing_removes_the_file(registry, archive):
    ghost = dataclasses.replace(registry.store.create_tenant("real"), id="ten_ghost")  # not in the store
    with pytest.raises(NotFoundError):
        _ingest(registry, ghost, "bot", archive)
    assert registry.storage.digests() == []


def test_record_failure_keeps_content_another_record_uses(registry, archive):
    owner = registry.store.create_tenant("owner")
    record = _ingest(registry, owner, "bot", archive)
    ghost = dataclasses.replace(owner, id="ten_ghost")
    with pytest.raises(NotFoundError):
        _ingest(registry, ghost, "bot", archive)
    assert registry.storage.digests() == [record.sha256]


def test_concurrent_uploads_cannot_both_pass_the_count_limit(registry, archive):
    tenant = registry.store.create_tenant("one", policy={"max_adapters": 1})
    outcomes: list[object] = []

    def upload(name):
        try:
            outcomes.append(_ingest(registry, tenant, name, archive))
        except ApiError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=upload, args=(f"bot-{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [o for o in outcomes if isinstance(o, ApiError)]
    assert len(outcomes) - len(refused) == 1 and {e.code for e in refused} == {"adapter_quota_exceeded"}
    assert registry.store.adapter_totals(tenant.id).count == 1


def test_limits_are_the_tenants_parsed_policy_defaults_included(registry, archive):
    """The registry reads TenantPolicy's max_adapters / max_adapter_bytes (defaults 100 and 20 GiB); a bad
    value never reaches it: the store refuses it when it is written (one parser, one error)."""
    roomy = registry.store.create_tenant("roomy")
    assert (roomy.policy.max_adapters, roomy.policy.max_adapter_bytes) == (100, 20 << 30)
    tiny = registry.store.create_tenant("tiny", policy={"max_adapter_bytes": 10})
    with pytest.raises(ApiError) as refused:
        _ingest(registry, tiny, "bot", archive)
    assert refused.value.code == "adapter_quota_exceeded" and "limit of 10 bytes" in refused.value.message
    with pytest.raises(InvalidPolicy, match="max_adapters"):
        registry.store.create_tenant("many", policy={"max_adapters": "many"})


def test_config_is_validated(llama_dir):
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        AdapterUploadConfig(ModelConfig.from_pretrained(llama_dir), max_lora_rank=0)
