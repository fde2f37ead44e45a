"""The worker wire protocol: what a gateway sends an engine worker and what streams back.

Typed messages with JSON codecs. The same objects flow through the in-process client and over HTTP,
where `POST /generate` answers with NDJSON: one `GenerateDelta` per line until one has `finished=True`,
or one error line (a `wire.errors.RequestError`) if the request fails. A delta holds only what is new
since the previous one (new token ids, new text, their logprobs, a finish reason), so each line costs
the same whatever the position in the output. The gateway imports this package (and nothing of the
engine's internals) to talk to workers.

HTTP endpoints of a worker (worker/server.py), each behind the `WORKER_SECRET_HEADER`:
    POST /generate  GenerateRequest -> NDJSON stream of GenerateDelta, ending finished or with an error
                    line; a body that is not a GenerateRequest is answered 400 with one error line
    POST /abort     {"request_id": str} -> {"aborted": bool}
    GET  /state     -> WorkerState
    GET  /health    -> {"status": "ok"}
    POST /adapters/unload  {"sha256": str} -> {"unloaded": bool}: new requests for that adapter load it
                    again; its device slot and host memory are freed once no running request uses it
    GET  /metrics   -> Prometheus text (worker/metrics.py); the secret may also come as a bearer token,
                    and a worker started with --public-metrics serves it without one
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from wire.errors import RequestError
from wire.sampling import SamplingParams

WORKER_SECRET_HEADER = "x-loraplex-worker-secret"
TRACEPARENT_HEADER = "traceparent"
MAX_REQUEST_ID_LENGTH = 200

# The radix prefix cache's namespace key: (cache salt, adapter content digest or ""). Two requests share
# cached KV only within one namespace.
PrefixNamespace = tuple[str, str]


def prefix_namespace(cache_salt: str, adapter_sha256: str | None) -> PrefixNamespace:
    """The namespace a request's prompt is cached under, on the engine and in the gateway's routing index."""
    return (cache_salt, adapter_sha256 or "")


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
    """One generation, as the gateway asks a worker for it. Validated on construction (ProtocolError)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    adapter: AdapterSpec | None = None
    # The salt the request's prompt is cached under: the tenant's own (chosen by the server, never by a
    # client) or the public salt an operator shares (see gateway/openai/routes.py). Not the namespace
    # itself: that also holds the adapter's content (`prefix_namespace`).
    cache_salt: str = ""
    traceparent: str | None = None  # W3C trace context of the gateway span

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not 0 < len(self.request_id) <= MAX_REQUEST_ID_LENGTH:
            raise ProtocolError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LENGTH} chars")
        if not isinstance(self.prompt_token_ids, list) or not self.prompt_token_ids:
            raise ProtocolError("prompt_token_ids must be a non-empty list of ints")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt_token_ids):
            raise ProtocolError("prompt_token_ids must hold only ints")
        if not isinstance(self.sampling, SamplingParams):
            raise ProtocolError("sampling must be a SamplingParams")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ProtocolError("priority must be an int")
        if not isinstance(self.cache_salt, str):
            raise ProtocolError("cache_salt must be a string")
        if self.traceparent is not None and not isinstance(self.traceparent, str):
            raise ProtocolError("traceparent must be a string or null")

    @property
    def prefix_namespace(self) -> PrefixNamespace:
        return prefix_namespace(self.cache_salt, self.adapter.sha256 if self.adapter else None)

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "sampling": self.sampling.to_json(), "priority": self.priority,
                "adapter": asdict(self.adapter) if self.adapter else None, "cache_salt": self.cache_salt,
                "traceparent": self.traceparent}

    @classmethod
    def from_json(cls, data: Any) -> GenerateRequest:
        """Strict: unknown fields, wrong types and sampling values out of bounds are ProtocolErrors."""
        if not isinstance(data, dict):
            raise ProtocolError("a generate request must be a JSON object")
        missing = {"request_id", "prompt_token_ids", "sampling"} - data.keys()
        if missing:
            raise ProtocolError(f"generate request is missing {sorted(missing)}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ProtocolError(f"generate request has unknown field(s) {unknown}")
        args = dict(data)
        try:
            args["sampling"] = SamplingParams.from_json(data["sampling"])
        except ValueError as e:
            raise ProtocolError(f"sampling: {e}") from None
        adapter = args.get("adapter")
        if adapter is not None:
            if not isinstance(adapter, dict) or set(adapter) != {"name", "sha256", "path"} or not all(
                    isinstance(v, str) for v in adapter.values()):
                raise ProtocolError("adapter must be {name, sha256, path} strings or null")
            args["adapter"] = AdapterSpec(**adapter)
        return cls(**args)


@dataclass(frozen=True)
class Logprob:
    """The sampled token's log-probability and the most likely alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SampleDelta:
    """What is new in one sample (`index` in 0..n-1) since its previous delta.

    `text` may lag `token_ids` (held back while it could still become a stop string or half a
    character); everything held back comes out by the delta that finishes the sample.
    """

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[Logprob] | None = None  # one per new token, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" (a failure is a RequestError instead)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass(frozen=True)
class GenerateDelta:
    """One step of one request: the samples that changed. The last delta of a request has finished=True."""

    request_id: str
    samples: list[SampleDelta]
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"type": "delta", "request_id": self.request_id, "samples": [_sample_json(s) for s in self.samples],
                "num_prompt_tokens": self.num_prompt_tokens, "num_cached_tokens": self.num_cached_tokens,
                "finished": self.finished}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerateDelta:
        samples = [
            SampleDelta(
                index=int(s["index"]), token_ids=[int(t) for t in s["token_ids"]], text=str(s["text"]),
                logprobs=None if s.get("logprobs") is None else [
                    Logprob(int(lp[0]), _float(lp[1]), tuple((int(t), _float(v)) for t, v in lp[2]))
                    for lp in s["logprobs"]
                ],
                finish_reason=s.get("finish_reason"), stop_reason=s.get("stop_reason"),
            )
            for s in data["samples"]
        ]
        return cls(str(data["request_id"]), samples, int(data["num_prompt_tokens"]),
                   int(data.get("num_cached_tokens", 0)), bool(data.get("finished", False)))


def _sample_json(s: SampleDelta) -> dict[str, Any]:
    out: dict[str, Any] = {"index": s.index, "token_ids": s.token_ids, "text": s.text}
    if s.logprobs is not None:
        out["logprobs"] = [(lp.token_id, lp.logprob, lp.top) for lp in s.logprobs]  # compact: positional
    if s.finish_reason is not None:
        out["finish_reason"] = s.finish_reason
        out["stop_reason"] = s.stop_reason
    return out


ADAPTER_LEVELS = ("gpu", "cpu")


@dataclass(frozen=True)
class AdapterResidency:
    """Where one adapter's weights are held on a worker: `gpu` in a device slot, `cpu` only in the host
    cache (an adapter in neither is not listed). `name` is the engine's name for it (a worker names
    adapters by their sha256)."""

    name: str
    level: str
    rank: int
    pinned: bool = False

    def __post_init__(self) -> None:
        if self.level not in ADAPTER_LEVELS:
            raise ProtocolError(f"adapter level must be one of {ADAPTER_LEVELS}, got {self.level!r}")


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
    weight_bytes: int = 0  # resident bytes of the base model's weights (packed when quantized)
    block_size: int = 0  # tokens per KV block
    kv_cache_dtype: str = ""  # float32, bfloat16 or int8 (rows with their scales)
    kv_cache_bytes: int = 0  # resident bytes of the KV cache
    max_loras: int = 0  # device slots: distinct adapters one step can run
    running_adapters: list[str] = field(default_factory=list)  # sha256 of adapters of running requests
    waiting_adapters: list[str] = field(default_factory=list)  # ... of waiting requests
    adapter_residency: list[AdapterResidency] = field(default_factory=list)  # each adapter held in memory
    num_preemptions: int = 0  # requests preempted (KV ran out) since the worker started
    prefix_waits: int = 0  # admissions put off a step while a running request computed their prompt prefix
    adapter_host_loads: int = 0  # adapter directories read into host memory since the worker started
    adapter_host_evictions: int = 0  # host-memory adapter entries dropped to stay within capacity
    faulted_steps: int = 0  # engine steps that raised and were re-run without the requests at fault
    isolated_failures: int = 0  # requests failed alone by a fault attributed to them
    structured_checked: int = 0  # finished constrained outputs validated against their schema
    structured_guard_failures: int = 0  # ... that failed (a grammar bug: the request got an error)
    grammar_ignored_formats: dict[str, int] = field(default_factory=dict)  # unknown formats, kept as annotations
    grammar_broken_evicted: int = 0  # cached grammars dropped because a matcher found them broken

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerState:
        # NOTE: fields with defaults may be absent (a worker of an older build).
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data or (
            f.default is MISSING and f.default_factory is MISSING)}
        if "adapter_residency" in values:
            values["adapter_residency"] = [AdapterResidency(**a) for a in values["adapter_residency"]]
        return cls(**values)


StreamMessage = GenerateDelta | RequestError


def parse_message(line: bytes | str) -> StreamMessage:
    """One NDJSON line of a generate stream: a delta, or the RequestError that ended the request."""
    try:
        data = json.loads(line)
        kind = data["type"]
        if kind == "delta":
            return GenerateDelta.from_json(data)
        if kind == "error":
            return RequestError.from_json(data)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ProtocolError(f"malformed generate stream line: {type(e).__name__}") from None
    raise ProtocolError(f"unknown message type {kind!r}")


def encode_message(message: StreamMessage) -> bytes:
    """The NDJSON line of a delta or an error (logprobs may be -inf: JSON's non-standard -Infinity)."""
    data = {"type": "error", **message.to_json()} if isinstance(message, RequestError) else message.to_json()
    return (json.dumps(data, allow_nan=True, separators=(",", ":")) + "\n").encode()


def _float(value: Any) -> float:
    value = float(value)
    return value if not math.isnan(value) else -math.inf
