"""What every admin handler starts from: the admin check, the gateway's state, telemetry, and parsing of
bodies and query parameters. Nothing here touches the store."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from gateway.auth.backend import ADMIN_SCOPE, TenantUser, require_scope
from gateway.http.errors import invalid_request
from gateway.observability.telemetry import TELEMETRY_STATE_KEY, Telemetry
from gateway.openai.schema import parse_body
from gateway.state import GatewayState


def require_admin(request: Request) -> TenantUser:
    return require_scope(request, ADMIN_SCOPE)  # 403 for any key without the admin scope


def gateway_of(request: Request) -> GatewayState:
    return request.state.gateway


def telemetry_of(request: Request) -> Telemetry:
    return getattr(request.state, TELEMETRY_STATE_KEY)


async def parse_json_body(request: Request, model: type[BaseModel]) -> Any:
    return parse_body(await request.body(), model)


def int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise invalid_request(f"{name} must be an integer, got {raw!r}.", param=name) from None
    if not lo <= value <= hi:
        raise invalid_request(f"{name} must be in [{lo}, {hi}], got {value}.", param=name)
    return value


