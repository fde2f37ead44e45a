"""adapters.storage: content addressing, idempotence, and writes that either complete or leave nothing."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from adapters.errors import AdapterError
from adapters.peft_format import validate_peft_adapter
from adapters.storage import AdapterStorage
from engine.config import ModelConfig


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture()
def adapter_dir(make_peft_adapter) -> Path:
    return make_peft_adapter(r=4, target_modules=["q_proj", "v_proj"])[0]


def test_put_stores_both_files_under_the_validated_digest(adapter_dir, llama_dir, tmp_path) -> None:
    manifest = validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")
    storage = AdapterStorage(tmp_path / "store")
    digest = storage.put(adapter_dir, expected_sha256=manifest.sha256)
    assert digest == manifest.sha256
    stored = storage.path_for(digest)
    assert stored == tmp_path / "store" / digest
    assert entries(stored) == ["adapter_config.json", "adapter_model.safetensors"]  # README.md is not kept
    for name in entries(stored):
        assert (stored / name).read_bytes() == (adapter_dir / name).read_bytes()
    assert storage.exists(digest) and storage.digests() == [digest]
    assert storage.total_bytes() == sum((adapter_dir / n).stat().st_size for n in entries(stored))
    assert validate_peft_adapter(stored, ModelConfig.from_pretrained(llama_dir), name="a") == manifest


def test_put_is_idempotent(adapter_dir, tmp_path) -> None:
    storage = AdapterStorage(tmp_path / "store")
    digest = storage.put(adapter_dir)
    inode = storage.path_for(digest).stat().st_ino
    assert storage.put(adapter_dir) == digest
    assert storage.path_for(digest).stat().st_ino == inode
    assert entries(tmp_path / "store") == [digest]


def test_concurrent_writers_of_the_same_content_keep_one_copy(adapter_dir, tmp_path) -> None:
    storage = AdapterStorage(tmp_path / "store")
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(storage.put(adapter_dir))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert entries(tmp_path / "store") == [results[0]]


def test_changed_config_is_a_new_entry(adapter_dir, tmp_path) -> None:
    storage = AdapterStorage(tmp_path / "store")
    first = storage.put(adapter_dir)
    config = adapter_dir / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 8', '"lora_alpha": 9'))
    second = storage.put(adapter_dir)
    assert first != second and storage.digests() == sorted([first, second])


def test_digest_mismatch_stores_nothing(adapter_dir, tmp_path) -> None:
    storage = AdapterStorage(tmp_path / "store")
    with pytest.raises(AdapterError, match=r"adapter files changed after validation \(expected digest 0{64}"):
        storage.put(adapter_dir, expected_sha256="0" * 64)
    assert entries(tmp_path / "store") == []


def test_failed_rename_leaves_nothing(adapter_dir, tmp_path, monkeypatch) -> None:
    """Fault injection: the final rename fails as it would across filesystems (EXDEV)."""
    storage = AdapterStorage(tmp_path / "store")

    def failing_rename(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError, match="cross-device"):
        storage.put(adapter_dir)
    assert entries(tmp_path / "store") == []


def test_missing_source_file_stores_nothing(adapter_dir, tmp_path) -> None:
    storage = AdapterStorage(tmp_path / "store")
    (adapter_dir / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        storage.put(adapter_dir)
    assert entries(tmp_path / "store") == []


def test_interrupted_write_is_invisible_and_swept(adapter_dir, tmp_path) -> None:
    root = tmp_path / "store"
    storage = AdapterStorage(root)
    digest = storage.put(adapter_dir)
    # What a writer killed before its rename leaves: a half-filled temporary directory.
    leftover = root / ".tmp-killed"
    leftover.mkdir()
    (leftover / "adapter_config.json").write_text("{")
    assert storage.digests() == [digest]
    assert storage.total_bytes() == sum(f.stat().st_size for f in storage.path_for(digest).iterdir())
    fresh = AdapterStorage(root)  # a young temporary may belong to a live writer: kept
    assert leftover.exists()
    old = time.time() - 7200
    os.utime(leftover, (old, old))
    AdapterStorage(root)
    assert not leftover.exists()
    assert fresh.digests() == [digest]


def test_delete(adapter_dir, tmp_path) -> None:
    storage = AdapterStorage(tmp_path / "store")
    digest = storage.put(adapter_dir)
    assert storage.delete(digest) is True
    assert not storage.exists(digest) and entries(tmp_path / "store") == []
    assert storage.delete(digest) is False
    with pytest.raises(KeyError, match=f"adapter {digest} is not in storage"):
        storage.path_for(digest)
    assert storage.total_bytes() == 0


@pytest.mark.parametrize("bad", ["../../etc", "A" * 64, "abc", "0" * 63 + "/"])
def test_digests_are_checked_before_touching_paths(tmp_path, bad) -> None:
    storage = AdapterStorage(tmp_path / "store")
    for call in (storage.path_for, storage.exists, storage.delete):
        with pytest.raises(ValueError, match="not an adapter digest"):
            call(bad)
