"""The router's own errors, in the shape of the route they answer (OpenAI's, Anthropic's on /v1/messages, the
Responses API's event on a /v1/responses stream), so clients raise their usual exceptions."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from reasoning_engine.server.anthropic.errors import error_body as anthropic_error_body
from reasoning_engine.server.anthropic.errors import is_anthropic_path
from reasoning_engine.server.errors import APIError

REPLICA_FAILED = "replica_failed"


def error_response(path: str, status: int, message: str) -> JSONResponse:
    error = APIError(status, message, code=REPLICA_FAILED if status >= 500 else None,
                     type="service_unavailable" if status == 503 else None)
    if is_anthropic_path(path):
        return JSONResponse(anthropic_error_body(error), status_code=status)
    return error.response()


def stream_error(path: str, message: str) -> bytes:
    """The event that ends a stream cut mid-way (its replica died or went silent), then the stream's end marker
    where the API has one."""
    def event(name: str, payload: dict) -> str:
        return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"

    if is_anthropic_path(path):
        return event("error", anthropic_error_body(APIError(502, message))).encode()
    if path.startswith("/v1/responses"):
        return event("error", {"type": "error", "code": REPLICA_FAILED, "message": message, "param": None}).encode()
    body = json.dumps(APIError(502, message, code=REPLICA_FAILED).body(), separators=(",", ":"), ensure_ascii=False)
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()
