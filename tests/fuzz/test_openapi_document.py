"""`GET /openapi.json`: a valid OpenAPI 3.1 document of exactly the public routes, served without a key."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from starlette.routing import Route

from gateway.openai.openapi import SAMPLING_BOUNDS, openapi_document
from gateway.openai.schema import ChatCompletionRequest, CompletionRequest
from tests.gateway.conftest import BASE_MODEL
from wire.sampling import MAX_N, MAX_SEED, InvalidSamplingParams, SamplingParams

pytestmark = [pytest.mark.fuzz, pytest.mark.xdist_group("fuzz")]

OPERATOR_PREFIXES = ("/admin", "/metrics")


def app_operations(app) -> set[tuple[str, str]]:
    """(method, path) of every tenant-facing route of the app, paths in OpenAPI's {param} form."""
    out = set()
    for route in app.routes:
        assert isinstance(route, Route)
        if route.path.startswith(OPERATOR_PREFIXES) or route.path == "/openapi.json":
            continue
        path = route.path.replace("{model_id:path}", "{model}")
        out |= {(m.lower(), path) for m in route.methods or () if m != "HEAD"}
    return out


def test_served_without_a_key_and_valid(fuzz_stack):
    resp = httpx.get(fuzz_stack.url + "/openapi.json", timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    doc = resp.json()
    assert doc == openapi_document() and doc["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(doc).validate()  # against the OpenAPI 3.1 meta-schema


def test_the_validation_is_not_vacuous():
    broken = openapi_document()
    broken["paths"]["/v1/models"]["get"]["responses"] = {"200": {"content": "json"}}
    with pytest.raises(Exception, match="content"):
        schemathesis.openapi.from_dict(broken).validate()


def test_documents_exactly_the_public_routes(fuzz_stack):
    doc = openapi_document()
    documented = {(method, path) for path, item in doc["paths"].items() for method in item if method != "parameters"}
    assert documented == app_operations(fuzz_stack.app)


def test_bodies_are_the_pydantic_models_and_errors_openai_shaped():
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["properties"]) == {f.alias or name for name, f in ChatCompletionRequest.model_fields.items()}
    assert "$defs" not in chat and "ChatMessage" in schemas  # refs point into components
    error = schemas["ErrorResponse"]["properties"]["error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method == "parameters" or path == "/health":
                continue
            assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"}, (method, path)
            assert "security" not in op  # the document-wide bearer scheme applies
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http", "scheme": "bearer", "description": "An API key: `lpx-...`."}
    assert doc["paths"]["/health"]["get"]["security"] == []


def test_sampling_bounds_are_wire_samplings():
    """Each documented bound is where SamplingParams starts refusing (inside: taken; just outside: refused)."""
    schemas = openapi_document()["components"]["schemas"]
    n = next(b for b in schemas["ChatCompletionRequest"]["properties"]["n"].get("anyOf", [
        schemas["ChatCompletionRequest"]["properties"]["n"]]) if b.get("type") == "integer")
    assert (n["minimum"], n["maximum"]) == (1, MAX_N)
    seed = next(b for b in schemas["CompletionRequest"]["properties"]["seed"]["anyOf"] if b.get("type") == "integer")
    assert seed["maximum"] == MAX_SEED
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    for name, bounds in SAMPLING_BOUNDS.items():
        assert name in fields, name
        target = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}.get(name, name)
        for key, limit in bounds.items():
            step = 1 if isinstance(limit, int) else 1e-6
            inside = limit if key in ("minimum", "maximum") else limit + step
            outside = limit - step if key in ("minimum", "exclusiveMinimum") else limit + step
            extra = {"max_tokens": 10**9} if target == "min_tokens" else {}
            SamplingParams(**{"max_tokens": 16, **extra, target: inside})
            with pytest.raises(InvalidSamplingParams):
                SamplingParams(**{"max_tokens": 16, **extra, target: outside})


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_real_successes_match_the_documented_responses(fuzz_stack, stream):
    """A served chat and completion, plain and streamed, pass Schemathesis' own response checks."""
    from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

    schema = schemathesis.openapi.from_dict(openapi_document())
    operations = {r.ok().label: r.ok() for r in schema.get_all_operations()}
    headers = fuzz_stack.headers(fuzz_stack.fuzzer_key)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for label, body in (("POST /v1/chat/completions", chat), ("POST /v1/completions", {"prompt": "hi"})):
        case = operations[label].Case(body={"model": BASE_MODEL, "max_tokens": 3, "stream": stream, **body},
                                      media_type="application/json")
        response = case.call(base_url=fuzz_stack.url, headers=headers, timeout=60)
        assert response.status_code == 200
        assert response.headers["content-type"][0].startswith("text/event-stream" if stream else "application/json")
        case.validate_response(response, checks=[content_type_conformance, response_schema_conformance],
                               headers=headers)
