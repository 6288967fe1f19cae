"""What every API route (chat, completions, Responses, Anthropic Messages) does around the one shared request path:
read the JSON body into its typed model, find the conversation's session key, and `serve_prepared`: submit the
prepared engine requests, run them (streamed or whole) and abort whatever is left however the request ends. Kept in
one place so the translators stay thin and every route answers broken bodies, refusals and departures the same
way."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from reasoning_engine.server.errors import APIError, bad_request, from_validation_error
from reasoning_engine.server.engine_client import EngineClient
from reasoning_engine.server.engine_requests import EngineRequests, EngineStreamResponse, shielded, unless_disconnected
from reasoning_engine.server.serving import Prepared

B = TypeVar("B", bound=BaseModel)


async def json_body(request: Request, model: type[B],
                    invalid: Callable[[ValidationError], APIError] = from_validation_error) -> B:
    """The body validated as `model`. Routes parse it themselves (not FastAPI) so that broken JSON, a non-object and
    a wrong field are 400s naming the parameter, not 422s; `invalid` words a validation error for the route."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc) from exc


def session_key(request: Request, *keys: str | None) -> str | None:
    """The conversation a request belongs to, for KV retention: the `x-session-id` header, else the first of the
    route's own keys that is set (OpenAI's `prompt_cache_key`, `user`; Anthropic's `metadata.user_id`)."""
    return request.headers.get("x-session-id") or next((key for key in keys if key), None)


async def serve_prepared(request: Request, engine: EngineClient, prepared: Prepared, request_id: str,
                         session: str | None, *, stream: bool,
                         streamed: Callable[[EngineRequests], AsyncGenerator[str, None]],
                         whole: Callable[[EngineRequests], Awaitable[dict[str, Any]]]) -> Response:
    """The one request pipeline: submit `prepared` as `request_id` (a refusal is a clean 4xx before any byte is
    sent), then either stream `streamed(...)`'s events or answer `whole(...)`'s body as JSON; the engine requests
    are aborted however it ends (finished, refused, client gone, cancelled)."""
    engine_requests = EngineRequests(engine, prepared.prompts, prepared.params, request_id, session,
                                     prepared.workload, prepared.error_param)
    await _start_or_close(request, engine_requests)
    if stream:
        return EngineStreamResponse(streamed(engine_requests), on_close=engine_requests.close)
    try:
        body = await unless_disconnected(request, whole(engine_requests))
    finally:
        await shielded(engine_requests.close())
    return JSONResponse(body)


async def _start_or_close(request: Request, engine_requests: EngineRequests) -> None:
    """Submit the requests and wait for their first output; if the engine refuses them or the client leaves first,
    abort (freeing their KV blocks) and re-raise."""
    try:
        await unless_disconnected(request, engine_requests.start())
    except BaseException:
        await shielded(engine_requests.close())
        raise
