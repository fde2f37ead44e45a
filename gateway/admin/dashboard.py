"""The operator pages: the dashboard at /admin (its files in gateway/static) and /metrics.

The dashboard is static HTML/JS/CSS shipped in the package (no CDN, no build step). Its page and
assets load without a key — they hold no data: the page asks for an admin key and sends it as a
Bearer token on every /admin/api call. A request that does present a key is still checked, so a
non-admin key gets 403 on the page and assets as on the API. /metrics needs an admin key unless the
telemetry config makes it public (a private scrape network).
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from gateway.auth.backend import ADMIN_SCOPE, DASHBOARD_PATH, METRICS_PATH, STATIC_PREFIX, require_scope
from gateway.http.errors import ApiError
from gateway.observability.metrics import PROMETHEUS_CONTENT_TYPE
from gateway.observability.telemetry import TELEMETRY_STATE_KEY

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
                "app.css": "text/css; charset=utf-8"}
def _refuse_non_admin(request: Request) -> None:
    """Anonymous callers may load pages; a caller with a key needs the admin scope (else 403)."""
    if request.user.is_authenticated:
        require_scope(request, ADMIN_SCOPE)


async def dashboard(request: Request) -> Response:
    _refuse_non_admin(request)
    return _static_file("index.html")


async def static_asset(request: Request) -> Response:
    _refuse_non_admin(request)
    return _static_file(request.path_params["name"])


def _static_file(name: str) -> Response:
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        raise ApiError(404, f"Unknown dashboard file {name!r}.", code="unknown_url")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers={"cache-control": "no-cache"})


async def metrics(request: Request) -> Response:
    telemetry = getattr(request.state, TELEMETRY_STATE_KEY)
    if not (telemetry.config.metrics_public and not request.user.is_authenticated):
        require_scope(request, ADMIN_SCOPE)
    gateway = request.state.gateway
    body = await telemetry.render_metrics(gateway.engine, gateway.admission.queue)
    return Response(body, media_type=PROMETHEUS_CONTENT_TYPE)


routes = [
    Route(DASHBOARD_PATH, dashboard, methods=["GET"]),
    Route(DASHBOARD_PATH + "/", dashboard, methods=["GET"]),
    Route(STATIC_PREFIX + "{name}", static_asset, methods=["GET"]),
    Route(METRICS_PATH, metrics, methods=["GET"]),
]
