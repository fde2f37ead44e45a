"""The worker wire protocol: what a gateway sends an engine worker and what streams back.

Plain dataclasses that round-trip through JSON (`to_json` / `from_json`). The same messages flow through
the in-process client and over HTTP, where `POST /generate` answers with NDJSON: one `GenerateDelta`
per line until one has `finished=True`, or a `GenerateError` line if the request fails. The gateway
imports this module (and nothing else of the engine's internals) to talk to workers.

HTTP endpoints of a worker (worker/server.py), each behind the `WORKER_SECRET_HEADER`:
    POST /generate  GenerateRequest -> NDJSON stream of GenerateDelta | GenerateError
    POST /abort     {"request_id": str} -> {"aborted": bool}
    GET  /state     -> WorkerState
    GET  /health    -> {"status": "ok"}
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

WORKER_SECRET_HEADER = "x-loraplex-worker-secret"
TRACEPARENT_HEADER = "traceparent"
MAX_REQUEST_ID_LENGTH = 200

# Error codes a worker reports in GenerateError.code; the gateway maps them to HTTP statuses.
INVALID_REQUEST = "invalid_request"  # can never run as asked (bad params, prompt too long): 400
ADAPTER_UNAVAILABLE = "adapter_unavailable"  # the adapter cannot be loaded or is unsupported
ENGINE_ERROR = "engine_error"  # the engine failed while running it: 500


class ProtocolError(ValueError):
    """A message does not have the protocol's shape (names the field)."""


@dataclass(frozen=True)
class AdapterSpec:
    """Which adapter to run with. `sha256` is its identity (workers key adapters by it); `path` is where
    the worker can read its files (content-addressed storage shared with the gateway)."""

    name: str
    sha256: str
    path: str


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams field values (wire/sampling.py names)
    priority: int = 0
    adapter: AdapterSpec | None = None
    cache_salt: str = ""  # the tenant's prefix-cache namespace, chosen by the server
    traceparent: str | None = None  # W3C trace context of the gateway span

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not 0 < len(self.request_id) <= MAX_REQUEST_ID_LENGTH:
            raise ProtocolError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LENGTH} chars")
        if not isinstance(self.prompt_token_ids, list) or not self.prompt_token_ids:
            raise ProtocolError("prompt_token_ids must be a non-empty list of ints")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt_token_ids):
            raise ProtocolError("prompt_token_ids must hold only ints")
        if not isinstance(self.sampling, dict):
            raise ProtocolError("sampling must be an object of SamplingParams fields")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ProtocolError("priority must be an int")
        if not isinstance(self.cache_salt, str):
            raise ProtocolError("cache_salt must be a string")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> GenerateRequest:
        if not isinstance(data, dict):
            raise ProtocolError("a generate request must be a JSON object")
        known = {f.name for f in fields(cls)}
        missing = {"request_id", "prompt_token_ids", "sampling"} - data.keys()
        if missing:
            raise ProtocolError(f"generate request is missing {sorted(missing)}")
        args = {k: v for k, v in data.items() if k in known}
        adapter = args.get("adapter")
        if adapter is not None:
            if not isinstance(adapter, dict) or not all(isinstance(adapter.get(k), str) for k in ("name", "sha256", "path")):
                raise ProtocolError("adapter must be {name, sha256, path} strings or null")
            args["adapter"] = AdapterSpec(adapter["name"], adapter["sha256"], adapter["path"])
        return cls(**args)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SampleDelta:
    """New tokens of one sample (`index` in 0..n-1) since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # set when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class GenerateDelta:
    request_id: str
    samples: list[SampleDelta]
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    finished: bool = False
    error: str | None = None  # the engine failed the request (finish_reason "error")

    def to_json(self) -> dict[str, Any]:
        return {"type": "delta", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateDelta:
        samples = [
            SampleDelta(
                index=s["index"], text=s["text"], token_ids=s["token_ids"],
                logprobs=None if s.get("logprobs") is None else [
                    TokenLogprob(lp["token_id"], _float(lp["logprob"]), [(t, _float(v)) for t, v in lp["top"]])
                    for lp in s["logprobs"]
                ],
                finish_reason=s.get("finish_reason"), stop_reason=s.get("stop_reason"),
            )
            for s in data["samples"]
        ]
        return cls(data["request_id"], samples, data["num_prompt_tokens"], data.get("num_cached_tokens", 0),
                   data.get("finished", False), data.get("error"))


@dataclass(frozen=True)
class GenerateError:
    """The request failed before or while running. `code` is one of the module's error codes."""

    request_id: str
    code: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "error", **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateError:
        return cls(data.get("request_id", ""), data.get("code", ENGINE_ERROR), data.get("message", "unknown error"))


@dataclass(frozen=True)
class WorkerState:
    """Load and cache state of one worker, for routing and the admin dashboard."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_cache_blocks: int
    resident_adapters: list[str]  # sha256 of adapters loaded in the worker
    model: str
    adapter_loads: int = 0  # adapters copied into a device slot since the worker started
    adapter_evictions: int = 0  # resident adapters replaced to make room since the worker started

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerState:
        # NOTE: fields with defaults may be absent (a worker of an older build).
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data or f.default is MISSING})


def parse_message(line: bytes | str) -> GenerateDelta | GenerateError:
    """One NDJSON line of a generate stream."""
    try:
        data = json.loads(line)
        kind = data["type"]
        if kind == "delta":
            return GenerateDelta.from_json(data)
        if kind == "error":
            return GenerateError.from_json(data)
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"malformed generate stream line: {e}") from None
    raise ProtocolError(f"unknown message type {kind!r}")


def encode_message(message: GenerateDelta | GenerateError) -> bytes:
    return (json.dumps(message.to_json(), allow_nan=True, separators=(",", ":")) + "\n").encode()


def _float(value: Any) -> float:
    value = float(value)
    return value if not math.isnan(value) else -math.inf
