"""Errors on the Messages paths in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, so its
SDK raises its own classes; the app's error handlers use it for every path under PATH_PREFIX."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from reasoning_engine.server.errors import APIError

PATH_PREFIX = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}
ANTHROPIC_ERROR_SCHEMA: dict[str, Any] = {  # error_body's shape, for the OpenAPI document
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"enum": sorted({*_ERROR_TYPES.values(), "invalid_request_error", "api_error"})},
                       "message": {"type": "string"}}}},
}


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error object; it has no `param`, so the message starts with the parameter at fault."""
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)
