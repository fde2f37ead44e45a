"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Handlers raise `ApiError` (or a subclass); the app's exception handlers turn it, Starlette's
HTTPException and anything unexpected into this shape. Nothing ever answers with a stack trace.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
}
# The code an error carries when its raiser names none: clients branch on a stable code, never on text.
DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limit_exceeded",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or DEFAULT_CODES.get(status, "internal_error" if status >= 500 else "invalid_request")
        self.error_type = error_type or ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                                          "invalid_request_error")
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model '{model}' does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def invalid_api_key() -> ApiError:
    return ApiError(401, "Incorrect API key provided. Pass a valid key as 'Authorization: Bearer lpx-...'.",
                    code="invalid_api_key")


def service_unavailable(message: str, retry_after_s: int = 1) -> ApiError:
    return ApiError(503, message, code="service_unavailable", headers={"retry-after": str(retry_after_s)})
