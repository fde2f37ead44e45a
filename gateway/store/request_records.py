"""How both backends keep a `RequestRecord`: a SQLite row (sqlite_schema.py, table request_records) and a
Redis JSON string (redis_keys.py, `request:{tenant}:{request id}`). Reading either back gives an equal record."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.store.models import RequestRecord

# the order of record_row's values and of record_from_row's columns
SQLITE_COLUMNS = ("request_id", "tenant_id", "key_id", "model", "adapter", "created_at", "prompt_tokens",
                  "completion_tokens", "cached_tokens", "finish_reasons", "outcome", "end_user", "safety_identifier",
                  "metadata")


def record_row(r: RequestRecord) -> tuple[Any, ...]:
    return (r.request_id, r.tenant_id, r.key_id, r.model, r.adapter, r.created_at, r.prompt_tokens,
            r.completion_tokens, r.cached_tokens, json.dumps(list(r.finish_reasons)), r.outcome, r.user,
            r.safety_identifier, json.dumps(r.metadata, sort_keys=True))


def record_from_row(row: Sequence[Any]) -> RequestRecord:
    (request_id, tenant_id, key_id, model, adapter, created_at, prompt_tokens, completion_tokens, cached_tokens,
     finish_reasons, outcome, user, safety_identifier, metadata) = tuple(row)
    return RequestRecord(request_id, tenant_id, key_id, model, adapter, created_at, prompt_tokens, completion_tokens,
                         cached_tokens, tuple(json.loads(finish_reasons)), outcome, user, safety_identifier,
                         json.loads(metadata))


def record_json(r: RequestRecord) -> str:
    return json.dumps(dict(zip(SQLITE_COLUMNS, record_row(r), strict=True)), separators=(",", ":"))


def record_from_json(text: str) -> RequestRecord:
    fields = json.loads(text)
    return record_from_row([fields[c] for c in SQLITE_COLUMNS])
