"""One error taxonomy from the engine to the HTTP answer: stable codes, each with its status and type.

A request that fails anywhere (refused at intake, failed by the engine, lost with its worker) ends in one
`RequestError` carrying an `ErrorCode`. The engine and the worker raise or emit it; the worker protocol
carries it as one NDJSON line; the gateway's worker clients raise the same class; the OpenAI routes
answer `code.http_status` with `code.openai_type` and `code.value` as the error's `code`.

NOTE: a RequestError's message is shown to the tenant. It says what went wrong in a sentence and never
holds exception text, file paths or internal addresses: whoever catches the underlying fault logs that
detail (once, bounded) and raises a RequestError with a short message, or with none (the code's default).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE_CHARS = 500  # longer messages are cut (they cross the wire and end up in tenants' logs)


@dataclass(frozen=True)
class _Meaning:
    http_status: int
    openai_type: str  # OpenAI's error `type`
    default_message: str
    retry_after_s: int | None = None  # sent as `retry-after` where set


class ErrorCode(enum.StrEnum):
    """Why a request failed. The values are stable: tenants see them as the OpenAI error `code`."""

    INVALID_REQUEST = "invalid_request"  # can never run as asked (bad parameter, prompt too long, bad schema)
    ADAPTER_UNAVAILABLE = "adapter_unavailable"  # the adapter cannot be loaded or served right now
    WORKER_UNAVAILABLE = "worker_unavailable"  # no engine worker could take it; nothing ran
    ENGINE_ERROR = "engine_error"  # the engine or its worker failed while running it

    @property
    def http_status(self) -> int:
        return _MEANINGS[self].http_status

    @property
    def openai_type(self) -> str:
        return _MEANINGS[self].openai_type

    @property
    def default_message(self) -> str:
        return _MEANINGS[self].default_message

    @property
    def retry_after_s(self) -> int | None:
        return _MEANINGS[self].retry_after_s


_MEANINGS: dict[ErrorCode, _Meaning] = {
    ErrorCode.INVALID_REQUEST: _Meaning(400, "invalid_request_error", "The request cannot be served as asked."),
    ErrorCode.ADAPTER_UNAVAILABLE: _Meaning(
        503, "server_error", "The adapter cannot be served right now.", retry_after_s=1),
    ErrorCode.WORKER_UNAVAILABLE: _Meaning(
        503, "server_error", "No engine worker is available right now. Retry shortly.", retry_after_s=1),
    ErrorCode.ENGINE_ERROR: _Meaning(500, "server_error", "The engine worker failed while generating."),
}


class RequestError(Exception):
    """A request failed with a stable `code`; `message` is safe to show the tenant (see the module note).

    `param` names the request field at fault when there is one (OpenAI's `param`). `request_id` is set
    where the failure is reported in a stream of many requests (the engine's step, the wire).
    """

    def __init__(self, code: ErrorCode, message: str | None = None, *, param: str | None = None,
                 request_id: str = "") -> None:
        text = (message or code.default_message).strip() or code.default_message
        super().__init__(text[:MAX_MESSAGE_CHARS])
        self.code = code
        self.message = text[:MAX_MESSAGE_CHARS]
        self.param = param
        self.request_id = request_id

    def __reduce__(self) -> tuple:  # NOTE: Exception's own pickles only args (the message) and loses the code
        return (type(self), (self.code, self.message), {"param": self.param, "request_id": self.request_id})

    def __repr__(self) -> str:
        return f"RequestError({self.code.value}, {self.message!r}, param={self.param!r})"

    def for_request(self, request_id: str) -> RequestError:
        """The same error, reported for `request_id`."""
        return RequestError(self.code, self.message, param=self.param, request_id=request_id)

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "code": self.code.value, "message": self.message,
                "param": self.param}

    @classmethod
    def from_json(cls, data: Any) -> RequestError:
        """Decode a peer's error. An unknown code (a newer peer) reads as engine_error, never dropped."""
        if not isinstance(data, dict):
            raise ValueError("an error must be a JSON object")
        try:
            code = ErrorCode(str(data.get("code")))
        except ValueError:
            code = ErrorCode.ENGINE_ERROR
        message, param, rid = data.get("message"), data.get("param"), data.get("request_id", "")
        return cls(code, message if isinstance(message, str) else None,
                   param=param if isinstance(param, str) else None, request_id=rid if isinstance(rid, str) else "")
