"""`build_app`: the gateway's Starlette app.

Middleware, outermost first: x-request-id → security headers (nosniff; CSP and frame denial on /admin) →
telemetry (server span, request metrics) → error guard (no bare 500s) → body size limit (413) →
authentication (API keys, scopes; the dashboard page loads keyless). Shared objects live in lifespan state
as `request.state.gateway`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.adapters.registry import AdapterRegistry, AdapterUploadConfig
from gateway.adapters.resolver import ModelResolver
from gateway.adapters.routes import AdapterApi, UploadLimits, upload_body_limit
from gateway.admin.dashboard import routes as dashboard_routes
from gateway.admin.routes import routes as admin_routes
from gateway.admission.base import RequestAdmission, StoreUsageReporter, UsageReporter
from gateway.admission.instrumented import InstrumentedAdmission
from gateway.auth.backend import DASHBOARD_PATH, ApiKeyBackend, KeylessPagesBackend, on_auth_error
from gateway.http.errors import ApiError
from gateway.http.middleware import (
    ErrorGuardMiddleware,
    RequestIdMiddleware,
    RouteBodySizeLimit,
    SecurityHeadersMiddleware,
)
from gateway.http.prompt_pool import PromptPool
from gateway.observability.telemetry import TELEMETRY_STATE_KEY, Telemetry, TelemetryMiddleware
from gateway.observability.tracing import TracedAuthBackend
from gateway.openai.openapi import openapi_route
from gateway.openai.routes import routes as openai_routes
from gateway.state import GatewayConfig, GatewayState
from gateway.store import Store
from gateway.workers.client import EngineClient
from tokenization.tokenizer import Tokenizer


def build_app(config: GatewayConfig, store: Store, engine: EngineClient, tokenizer: Tokenizer, *,
              admission: RequestAdmission, usage: UsageReporter | None = None,
              resources: Callable[[], AbstractAsyncContextManager] | None = None,
              adapter_uploads: AdapterUploadConfig | None = None,
              telemetry: Telemetry | None = None, prompts: PromptPool | None = None) -> Starlette:
    """The gateway app over its collaborators, each passed in (nothing is built behind the caller's back):
    `admission` is the request gate (gateway/admission/settings.py `build_admission`, the same for serve
    and tests); `usage` records final usage (default: one store write per request); `resources` (e.g. a
    worker supervisor) is entered for the app's lifetime; `telemetry` (metrics, traces, the dashboard's
    activity window) defaults to one that exports nothing; `prompts` (the threads that render and tokenize)
defaults to `config.prompt_threads` of them.

    Shutdown, in order: the admission is closed (lease renewals, quota-store connections), then the engine
    client, then the usage reporter (its last flush, after every request has settled), then `resources`.
    """
    telemetry = telemetry or Telemetry()
    instrumented = InstrumentedAdmission(admission, telemetry)
    state = GatewayState(
        config=config, store=store, engine=engine, tokenizer=tokenizer,
        resolver=ModelResolver(store, config.served_model_name, int(time.time())),
        admission=instrumented, usage=usage or StoreUsageReporter(store),
        tool_calling=tokenizer.tool_calling(config.tool_call_parser),  # logs a warning for a template without tools
        prompts=prompts or PromptPool(config.prompt_threads),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict]:
        async with contextlib.AsyncExitStack() as stack:
            if resources is not None:
                await stack.enter_async_context(resources())
            stack.push_async_callback(state.usage.close)
            stack.push_async_callback(engine.close)
            stack.push_async_callback(instrumented.close)
            await stack.enter_async_context(telemetry.running(engine, instrumented.queue))
            yield {"gateway": state, TELEMETRY_STATE_KEY: telemetry}

    async def health(request: Request) -> Response:
        healthy = await engine.healthy()
        return JSONResponse({"status": "ok" if healthy else "degraded", "engine": healthy},
                            status_code=200 if healthy else 503)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message, code = f"Unknown request URL: {request.method} {request.url.path}.", "unknown_url"
        elif exc.status_code == 405:
            message, code = f"Method {request.method} is not allowed on {request.url.path}.", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        error = ApiError(exc.status_code, message, code=code)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    return Starlette(
        routes=[Route("/health", health, methods=["GET"]), openapi_route(), *openai_routes, *admin_routes,
                *dashboard_routes,
                *AdapterApi(AdapterRegistry(store, config.adapter_root, adapter_uploads, engine), config.served_model_name,
                            UploadLimits(config.upload_read_timeout_s, config.max_concurrent_uploads)).routes],
        middleware=[
            Middleware(RequestIdMiddleware),
            Middleware(SecurityHeadersMiddleware, admin_prefix=DASHBOARD_PATH),
            Middleware(TelemetryMiddleware, telemetry=telemetry),
            Middleware(ErrorGuardMiddleware),
            Middleware(RouteBodySizeLimit, max_bytes=config.max_body_bytes,
                       per_route=upload_body_limit(adapter_uploads.max_upload_bytes) if adapter_uploads else {}),
            Middleware(AuthenticationMiddleware, on_error=on_auth_error, backend=TracedAuthBackend(
                KeylessPagesBackend(ApiKeyBackend(store), telemetry.config.metrics_public), telemetry.tracer)),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error},
        lifespan=lifespan,
    )
