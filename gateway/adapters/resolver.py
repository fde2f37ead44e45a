"""`model` → the served base model or one of the caller's adapters (own, or shared by an operator).

Names: the base model's served name; an adapter's `name` (its latest live version) or `name@N`. An
adapter of another tenant that is not shared resolves exactly like a name that does not exist: 404.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from gateway.store import AdapterRecord, Store, Tenant
from wire.protocol import AdapterSpec

_ADAPTER_REF = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,63})(?:@v?(?P<version>[0-9]{1,9}))?")


@dataclass(frozen=True)
class ResolvedModel:
    served_name: str  # what responses echo in `model`
    adapter: AdapterRecord | None  # None: the base model

    def adapter_spec(self, adapter_root: Path) -> AdapterSpec | None:
        if self.adapter is None:
            return None
        return AdapterSpec(self.adapter.name, self.adapter.sha256, str(adapter_root / self.adapter.sha256))


@dataclass(frozen=True)
class ModelCard:
    id: str
    created: int
    owned_by: str
    parent: str | None
    root: str

    def to_json(self) -> dict:
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": self.owned_by,
                "root": self.root, "parent": self.parent}


class ModelResolver:
    """Reads the store on every call (adapters change while the gateway runs)."""

    def __init__(self, store: Store, base_name: str, base_created: int) -> None:
        self.store = store
        self.base_name = base_name
        self.base_created = base_created

    def resolve(self, tenant: Tenant, model: str) -> ResolvedModel | None:
        if model == self.base_name:
            return ResolvedModel(self.base_name, None)
        match = _ADAPTER_REF.fullmatch(model)
        if match is None:
            return None
        name, version = match["name"], match["version"]
        record = self.store.get_adapter(tenant.id, name, int(version) if version else None)
        if record is None:
            record = self._shared(tenant, name, int(version) if version else None)
        if record is None or record.deleted_at is not None:
            return None
        return ResolvedModel(model, record)

    def _shared(self, tenant: Tenant, name: str, version: int | None) -> AdapterRecord | None:
        """A live shared adapter of another tenant; with several owners of the same name, none (ambiguous
        names must be addressed by their own tenant)."""
        candidates = [r for r in self.store.list_adapters(tenant.id) if r.tenant_id != tenant.id and r.name == name
                      and r.shared and r.deleted_at is None and (version is None or r.version == version)]
        owners = {r.tenant_id for r in candidates}
        if len(owners) != 1:
            return None
        return max(candidates, key=lambda r: r.version)

    def list_models(self, tenant: Tenant) -> list[ModelCard]:
        """The base model, then each visible adapter by name (latest version) and as name@version."""
        cards = [ModelCard(self.base_name, self.base_created, "loraplex", None, self.base_name)]
        live = [r for r in self.store.list_adapters(tenant.id) if r.deleted_at is None]
        latest: dict[str, AdapterRecord] = {}
        for record in live:
            if record.tenant_id != tenant.id and record.name in latest and latest[record.name].tenant_id == tenant.id:
                continue  # the tenant's own adapter wins the bare name
            if record.name not in latest or record.version > latest[record.name].version or (
                    record.tenant_id == tenant.id and latest[record.name].tenant_id != tenant.id):
                latest[record.name] = record
        for name, record in sorted(latest.items()):
            owner = "you" if record.tenant_id == tenant.id else "shared"
            cards.append(ModelCard(name, int(record.created_at), owner, self.base_name, self.base_name))
        for record in live:
            owner = "you" if record.tenant_id == tenant.id else "shared"
            cards.append(ModelCard(record.ref, int(record.created_at), owner, self.base_name, self.base_name))
        return cards
