"""`GET /openapi.json`: an OpenAPI 3.1 document of the public API, the one tenants (and fuzzers) read.

Request bodies are the pydantic models of gateway/openai/schema.py (`model_json_schema`, with every
`$defs` entry moved to `components/schemas`), so the document cannot drift from what the handlers
parse; the sampling fields carry the bounds wire.sampling checks (`SAMPLING_BOUNDS`). Success bodies are written here, as loose as the handlers' output allows (required keys and
their types); every 4xx/5xx is OpenAI's error shape (`ErrorResponse`). Operator routes (/admin, /metrics)
are left out: they are not the tenant API.

Like FastAPI's and vLLM's, the document itself needs no key (gateway/auth/backend.py PUBLIC_PATHS).
"""

from __future__ import annotations

import copy
import functools
from importlib import metadata
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.adapters.routes import MAX_DESCRIPTION_CHARS, UPLOAD_FILE_FIELD, UPLOAD_PATH
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest
from wire.sampling import MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_TEMPERATURE

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{model}"

# The statuses a tenant route may answer with an error body (http/errors.py ERROR_TYPES).
ERROR_STATUSES = {
    "400": "The body or a parameter is invalid (the error names it in `param`).",
    "401": "No API key, or an unknown, revoked or expired one.",
    "403": "The key lacks the scope, or its tenant is suspended.",
    "404": "Unknown model, adapter or URL (another tenant's adapter answers the same).",
    "413": "The body is larger than the gateway accepts.",
    "429": "A rate limit, concurrency limit or budget of the tenant; see `retry-after`.",
    "501": "Adapter uploads are off on this gateway.",
    "503": "No worker can take the request now; see `retry-after`.",
}


# The numeric bounds wire.sampling.SamplingParams enforces (the one place they are checked), told to
# clients here so that a schema-valid request is one the server takes.
SAMPLING_BOUNDS: dict[str, dict[str, float]] = {
    "n": {"minimum": 1, "maximum": MAX_N},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0},
    "temperature": {"minimum": 0, "maximum": MAX_TEMPERATURE},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "seed": {"minimum": 0, "maximum": MAX_SEED},
    "logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},  # completions' integer (chat's is a boolean)
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
}


def _with_bounds(model_schema: dict) -> dict:
    """The model's JSON schema with SAMPLING_BOUNDS put on the numeric branch of each bounded field."""
    for name, bounds in SAMPLING_BOUNDS.items():
        field = model_schema["properties"].get(name)
        for branch in [field, *field.get("anyOf", [])] if field else []:
            if branch.get("type") in ("integer", "number"):
                branch.update(bounds)
    return model_schema


def _schema(ref: str) -> dict:
    return {"$ref": _REF.format(model=ref)}


def _nullable(type_: str) -> dict:
    return {"type": [type_, "null"]}


_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": _nullable("string"),
                       "code": {"type": "string", "minLength": 1}},
    }},
}

_USAGE = {
    "type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
                   "total_tokens": {"type": "integer"}},
}


def _envelope(object_name: str, choice: dict) -> dict:
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices"],
        "properties": {"id": {"type": "string"}, "object": {"const": object_name}, "created": {"type": "integer"},
                       "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                       "usage": _schema("Usage")},
    }


_FINISH = {"type": ["string", "null"]}
# vLLM's extra: the stop string or stop token id that ended the choice; null for EOS, grammar or length
_STOP_REASON = {"type": ["string", "integer", "null"]}

_CHAT_COMPLETION = _envelope("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "finish_reason": _FINISH, "stop_reason": _STOP_REASON, "message": {
        "type": "object", "required": ["role"],
        "properties": {"role": {"const": "assistant"}, "content": _nullable("string"),
                       "tool_calls": {"type": "array", "items": {"type": "object"}}},
    }},
})

_COMPLETION = _envelope("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
                   "stop_reason": _STOP_REASON},
})

_MODEL = {
    "type": "object", "required": ["id", "object", "created", "owned_by"],
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                   "owned_by": {"type": "string"}, "root": _nullable("string"), "parent": _nullable("string")},
}

_ADAPTER_VERSION = {
    "type": "object", "required": ["object", "id", "name", "version", "sha256", "rank", "target_modules"],
    "properties": {"object": {"const": "adapter.version"}, "id": {"type": "string"}, "name": {"type": "string"},
                   "version": {"type": "integer"}, "sha256": {"type": "string"}, "rank": {"type": "integer"},
                   "target_modules": {"type": "array", "items": {"type": "string"}},
                   "size_bytes": {"type": "integer"}, "description": {"type": "string"},
                   "created": {"type": "integer"}, "shared": {"type": "boolean"}},
}

_ADAPTER = {
    "type": "object", "required": ["object", "id", "name", "latest_version", "versions"],
    "properties": {"object": {"const": "adapter"}, "id": {"type": "string"}, "name": {"type": "string"},
                   "latest_version": {"type": "integer"},
                   "versions": {"type": "array", "items": _schema("AdapterVersion")}},
}


def _list_of(item: str) -> dict:
    return {"type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _schema(item)}}}


_HAND_WRITTEN = {
    "ErrorResponse": _ERROR,
    "Usage": _USAGE,
    "ChatCompletion": _CHAT_COMPLETION,
    "Completion": _COMPLETION,
    "Model": _MODEL,
    "ModelList": _list_of("Model"),
    "AdapterVersion": _ADAPTER_VERSION,
    "Adapter": _ADAPTER,
    "AdapterList": _list_of("Adapter"),
    "AdapterDeleted": {
        "type": "object", "required": ["object", "id", "deleted", "versions"],
        "properties": {"object": {"const": "adapter.deleted"}, "id": {"type": "string"},
                       "name": {"type": "string"}, "deleted": {"const": True},
                       "versions": {"type": "array", "items": {"type": "integer"}}},
    },
    "AdapterUpload": {
        "type": "object", "required": [UPLOAD_FILE_FIELD, "name"],
        "properties": {UPLOAD_FILE_FIELD: {"type": "string", "format": "binary",
                                           "description": "A .tar.gz, .tgz, .tar or .zip of a PEFT adapter."},
                       "name": {"type": "string"},
                       "description": {"type": "string", "maxLength": MAX_DESCRIPTION_CHARS}},
    },
    "Health": {
        "type": "object", "required": ["status", "engine"],
        "properties": {"status": {"enum": ["ok", "degraded"]}, "engine": {"type": "boolean"}},
    },
}


def _json(ref: str) -> dict:
    return {"application/json": {"schema": _schema(ref)}}


def _errors() -> dict:
    return {status: {"description": why, "content": _json("ErrorResponse")} for status, why in ERROR_STATUSES.items()}


def _ok(ref: str, status: str = "200", description: str = "OK", stream: bool = False) -> dict:
    content = _json(ref)
    if stream:
        # NOTE: the schema of one server-sent event (as Schemathesis reads text/event-stream), not the stream
        content["text/event-stream"] = {"schema": {
            "type": "object", "required": ["data"],
            "description": "With `stream: true`, one event per chunk: `data: {chunk JSON}`, the last `data: [DONE]`.",
            "properties": {"data": {"type": "string"}}}}
    return {status: {"description": description, "content": content}, **_errors()}


def _path_param(name: str, description: str) -> dict:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def _body(ref: str) -> dict:
    return {"required": True, "content": _json(ref)}


def _paths() -> dict:
    adapter_name = _path_param("name", "The adapter's name.")
    return {
        "/v1/chat/completions": {"post": {
            "operationId": "createChatCompletion", "summary": "Chat completion (OpenAI-compatible).",
            "requestBody": _body("ChatCompletionRequest"), "responses": _ok("ChatCompletion", stream=True)}},
        "/v1/completions": {"post": {
            "operationId": "createCompletion", "summary": "Text completion (OpenAI-compatible).",
            "requestBody": _body("CompletionRequest"), "responses": _ok("Completion", stream=True)}},
        "/v1/models": {"get": {
            "operationId": "listModels", "summary": "The base model and the caller's (and shared) adapters.",
            "responses": _ok("ModelList")}},
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel", "summary": "One model card.",
            "parameters": [_path_param("model", "A model id: the base model, `adapter` or `adapter@version`.")],
            "responses": _ok("Model")}},
        UPLOAD_PATH: {
            "get": {"operationId": "listAdapters", "summary": "The caller's adapters.", "responses": _ok("AdapterList")},
            "post": {"operationId": "uploadAdapter", "summary": "Upload a PEFT adapter (a new version of its name).",
                     "requestBody": {"required": True, "content": {
                         "multipart/form-data": {"schema": _schema("AdapterUpload")}}},
                     "responses": _ok("AdapterVersion", status="201", description="Created")},
        },
        UPLOAD_PATH + "/{name}": {
            "parameters": [adapter_name],
            "get": {"operationId": "retrieveAdapter", "summary": "One adapter with every live version.",
                    "responses": _ok("Adapter")},
            "delete": {"operationId": "deleteAdapter", "summary": "Delete every version of an adapter.",
                       "responses": _ok("AdapterDeleted")},
        },
        "/health": {"get": {
            "operationId": "health", "summary": "Whether the gateway can reach a worker.", "security": [],
            "responses": {"200": {"description": "Healthy", "content": _json("Health")},
                          "503": {"description": "No healthy worker", "content": _json("Health")}}}},
    }


def _version() -> str:
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:  # a source tree that was never pip-installed
        return "0+source"


@functools.cache
def _document() -> dict[str, Any]:
    _, defs = models_json_schema([(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
                                 ref_template=_REF)
    components = {**defs.get("$defs", {}), **_HAND_WRITTEN}
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        components[request] = _with_bounds(components[request])
    return {
        "openapi": "3.1.0",
        "info": {"title": "loraplex", "version": _version(),
                 "description": "OpenAI-compatible multi-tenant multi-LoRA serving. Errors are OpenAI's shape: "
                                '{"error": {"message", "type", "param", "code"}}.'},
        "paths": _paths(),
        "components": {"schemas": components,
                       "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
                                                          "description": "An API key: `lpx-...`."}}},
        "security": [{"bearerAuth": []}],
    }


def openapi_document() -> dict[str, Any]:
    """The document (a fresh copy: callers may change it)."""
    return copy.deepcopy(_document())


async def openapi_json(request: Request) -> Response:
    return JSONResponse(_document())


def openapi_route() -> Route:
    return Route(OPENAPI_PATH, openapi_json, methods=["GET"])
