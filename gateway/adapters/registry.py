"""Tenant adapters: validate an uploaded archive, store it by content, record it as a new version, delete.

    registry.ingest(tenant, name, description, archive, work_dir) -> AdapterRecord
    registry.delete(tenant, name)                                  -> deleted AdapterRecords
    await registry.unload_from_workers(deleted)                    -> workers forget content no one uses

An upload is unpacked and validated (the engine loader's own checks: safetensors only, shapes and target
modules against the served model, rank <= the workers' max_lora_rank, finite values) inside a work
directory under the adapter root, then checked against the tenant's limits, then copied into the
content-addressed storage (temp dir + rename) and recorded in the store. Any failure leaves neither a
file nor a record; the caller removes the work directory.

Per-tenant limits are the tenant's TenantPolicy fields `max_adapters` (live versions) and
`max_adapter_bytes` (their stored bytes), defaults included: the same parsed policy admission enforces.
The store checks them in the same atomic write that records the version (Store.add_adapter_version with
`limits`), so they hold exactly across gateway replicas sharing a store.
"""

from __future__ import annotations

import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from adapters.adapter_files import REQUIRED_ADAPTER_FILES
from adapters.archive import ArchiveLimits, unpack_adapter_archive
from adapters.errors import AdapterError
from adapters.peft_format import validate_peft_adapter
from adapters.storage import AdapterStorage
from gateway.http.errors import ApiError
from gateway.store import AdapterRecord, AdapterTotals, Store, Tenant
from gateway.store.base import AdapterLimitExceeded, AdapterLimits
from gateway.workers.client import EngineClient
from wire.checkpoint import ModelConfig

DEFAULT_MAX_UPLOAD_BYTES = 2 << 30  # one uploaded archive
UPLOAD_WORK_PREFIX = ".tmp-upload-"  # AdapterStorage erases stale `.tmp-*` entries of crashed gateways


@dataclass(frozen=True)
class AdapterUploadConfig:
    """What uploads are validated against. `model_config` and `max_lora_rank` must be the workers'."""

    model_config: ModelConfig
    max_lora_rank: int
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    archive_limits: ArchiveLimits = field(default_factory=ArchiveLimits)
    accepted_base_models: tuple[str, ...] | None = None  # None: shapes decide, as in the engine's loader

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_upload_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def invalid_adapter(problem: str) -> ApiError:
    return ApiError(400, f"Adapter rejected: {problem}", param="file", code="invalid_adapter")


def adapter_quota_exceeded(message: str) -> ApiError:
    return ApiError(403, message, code="adapter_quota_exceeded", error_type="insufficient_quota")


class AdapterRegistry:
    """The tenant-facing side of adapters: uploads, deletes, and the files behind the records.

    NOTE: the limits need no lock: the store checks them atomically with the insert. `_commit_lock`
    serialises the storage write, the record and the removal of unreferenced files within this process,
    so a delete here never removes a file a concurrent upload here is about to reference.

    `engine` (every worker behind this gateway) is told to unload content whose last live record was
    deleted; None: nothing to tell (a gateway without workers of its own).
    """

    def __init__(self, store: Store, adapter_root: Path, config: AdapterUploadConfig | None,
                 engine: EngineClient | None = None) -> None:
        self.store = store
        self.engine = engine
        self.config = config  # None: this gateway lists and deletes adapters but takes no uploads
        self.storage = AdapterStorage(adapter_root)
        self._commit_lock = threading.Lock()

    def upload_config(self) -> AdapterUploadConfig:
        if self.config is None:
            raise ApiError(501, "This gateway takes no adapter uploads: it was started without the served "
                                "model's configuration.", code="uploads_disabled")
        return self.config

    def check_room(self, tenant: Tenant) -> None:
        """Refuse early (before any byte is read) when the tenant already holds its maximum count.
        Reads the store: run off the event loop."""
        totals = self.store.adapter_totals(tenant.id)
        if totals.count >= tenant.policy.max_adapters:
            raise adapter_quota_exceeded(
                f"Tenant '{tenant.name}' already has {totals.count} adapter versions, its limit is "
                f"{tenant.policy.max_adapters}; delete one first.")

    def new_work_dir(self) -> Path:
        """A fresh directory for one upload, next to the storage (same filesystem, cleaned if abandoned)."""
        return Path(tempfile.mkdtemp(prefix=UPLOAD_WORK_PREFIX, dir=self.storage.root))

    def ingest(self, tenant: Tenant, name: str, description: str, archive: Path, work_dir: Path) -> AdapterRecord:
        """Unpack, validate, check limits, store and record one uploaded archive (blocking; run off the
        event loop). Raises ApiError (400 invalid_adapter, 403 adapter_quota_exceeded); leaves nothing
        behind but what is inside `work_dir`."""
        config = self.upload_config()
        try:
            unpacked = unpack_adapter_archive(archive, work_dir / "adapter", config.archive_limits)
            manifest = validate_peft_adapter(unpacked, config.model_config, name=name,
                                             max_lora_rank=config.max_lora_rank,
                                             accepted_base_models=config.accepted_base_models)
        except AdapterError as e:
            raise invalid_adapter(str(e)) from None
        stored_bytes = sum((unpacked / f).stat().st_size for f in REQUIRED_ADAPTER_FILES)  # what storage keeps
        limits = AdapterLimits(max_count=tenant.policy.max_adapters, max_bytes=tenant.policy.max_adapter_bytes)
        with self._commit_lock:
            self._check_limits(tenant, self.store.adapter_totals(tenant.id), stored_bytes)  # early, not binding
            existed = self.storage.exists(manifest.sha256)
            try:
                self.storage.put(unpacked, expected_sha256=manifest.sha256)
            except AdapterError as e:
                raise invalid_adapter(str(e)) from None
            try:
                return self.store.add_adapter_version(
                    tenant.id, name, manifest.sha256, rank=manifest.rank, target_modules=manifest.target_modules,
                    size_bytes=stored_bytes, description=description, limits=limits)
            except AdapterLimitExceeded as e:  # another replica's upload got there first
                if not existed and not self.store.is_sha_referenced(manifest.sha256):
                    self.storage.delete(manifest.sha256)
                self._check_limits(tenant, e.totals, stored_bytes)
                raise adapter_quota_exceeded(f"Tenant '{tenant.name}' reached its adapter limits.") from None
            except BaseException:
                if not existed and not self.store.is_sha_referenced(manifest.sha256):
                    self.storage.delete(manifest.sha256)
                raise

    def delete(self, tenant: Tenant, name: str) -> list[AdapterRecord]:
        """Soft-delete every live version of the tenant's `name` (new requests for it get 404 at once;
        requests already running finish on the worker's loaded copy) and erase files no live record
        references. Returns the versions deleted; empty when there were none."""
        with self._commit_lock:
            live = [r for r in self.store.list_adapters(tenant.id, include_shared=False)
                    if r.name == name and r.deleted_at is None]
            if not live:
                return []
            self.store.delete_adapter(tenant.id, name)
            for sha in {r.sha256 for r in live}:
                if not self.store.is_sha_referenced(sha):
                    self.storage.delete(sha)
        return live

    async def unload_from_workers(self, deleted: list[AdapterRecord]) -> list[str]:
        """Tell every worker to unload the content of `deleted` versions that no live record (of any
        tenant) still references; returns those sha256s. Safe to call more than once."""
        if self.engine is None:
            return []
        gone = []
        for sha in sorted({r.sha256 for r in deleted}):
            if not await run_in_threadpool(self.store.is_sha_referenced, sha):
                gone.append(sha)
                await self.engine.unload_adapter(sha)
        return gone

    def _check_limits(self, tenant: Tenant, totals: AdapterTotals, new_bytes: int) -> None:
        """ApiError 403 when one more version of `new_bytes` would pass a limit, given `totals`."""
        limits = tenant.policy
        if totals.count + 1 > limits.max_adapters:
            raise adapter_quota_exceeded(
                f"Tenant '{tenant.name}' already has {totals.count} adapter versions, its limit is "
                f"{limits.max_adapters}; delete one first.")
        if totals.size_bytes + new_bytes > limits.max_adapter_bytes:
            raise adapter_quota_exceeded(
                f"This adapter ({new_bytes} bytes) would bring tenant '{tenant.name}' to "
                f"{totals.size_bytes + new_bytes} bytes of adapters, over its limit of "
                f"{limits.max_adapter_bytes} bytes.")
