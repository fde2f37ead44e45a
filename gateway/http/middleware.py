"""Pure ASGI middleware: x-request-id on every response, and a request body limit enforced while reading.

Both are pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass through
untouched.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.http.errors import error_body

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


class RequestIdMiddleware:
    """Puts `scope["state"]["request_id"]` (a sane client value or a fresh one) and echoes it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        presented = _header(scope, b"x-request-id")
        request_id = presented if presented and _SANE_REQUEST_ID.fullmatch(presented) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    """Answers 413 when Content-Length exceeds the limit, or once the bytes read so far do (chunked
    bodies). The app sees at most `max_bytes` of body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(send, scope)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, scope)

    async def _refuse(self, send: Send, scope: Scope) -> None:
        body = json.dumps(error_body(f"Request body is larger than the limit of {self.max_bytes} bytes.",
                                     "invalid_request_error", None, "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class ErrorGuardMiddleware:
    """Last line of defence: an exception nobody handled becomes an OpenAI-shaped 500 (logged, never
    shown to the client). Sits inside RequestIdMiddleware so the 500 carries the request id too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                return
            body = json.dumps(error_body("The server had an error while processing your request.",
                                         "server_error", None, "internal_error")).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


class RouteBodySizeLimit:
    """Body limits by route: `(method, path)` in `per_route` may carry that many bytes, every other request
    `max_bytes` (never less). Both are enforced while the body is read (BodySizeLimitMiddleware)."""

    def __init__(self, app: ASGIApp, max_bytes: int, per_route: Mapping[tuple[str, str], int]) -> None:
        self.default = BodySizeLimitMiddleware(app, max_bytes)
        self.routes = {route: BodySizeLimitMiddleware(app, max(max_bytes, limit)) for route, limit in per_route.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limited = self.routes.get((scope["method"], scope["path"])) if scope["type"] == "http" else None
        await (limited or self.default)(scope, receive, send)


ADMIN_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
             "font-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
ADMIN_SECURITY_HEADERS = ((b"content-security-policy", ADMIN_CSP.encode()), (b"x-frame-options", b"DENY"),
                          (b"referrer-policy", b"no-referrer"))


class SecurityHeadersMiddleware:
    """`X-Content-Type-Options: nosniff` on every response; on the operator pages and their API (paths
    under `admin_prefix`) also a Content-Security-Policy that runs only the dashboard's own script and
    style files (no inline code, no other origin, never framed), `X-Frame-Options: DENY` and
    `Referrer-Policy: no-referrer`. Errors included: it sits outside the error guard."""

    def __init__(self, app: ASGIApp, admin_prefix: str = "/admin") -> None:
        self.app = app
        self.admin_prefix = admin_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        admin = path == self.admin_prefix or path.startswith(self.admin_prefix + "/")
        added = [(b"x-content-type-options", b"nosniff"), *(ADMIN_SECURITY_HEADERS if admin else ())]
        names = {name for name, _ in added}

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": kept + added}
            await send(message)

        await self.app(scope, receive, send_with_headers)
