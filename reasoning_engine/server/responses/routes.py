"""The Responses routes: `POST /v1/responses` through the shared pipeline (routing.serve_prepared), and GET / DELETE of
stored responses and their input items."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from reasoning_engine.server.engine_requests import EngineRequests
from reasoning_engine.server.errors import APIError, bad_request
from reasoning_engine.server.openapi import errors
from reasoning_engine.server.responses.output import ResponseRun, event_stream
from reasoning_engine.server.responses.schema import ResponsesRequest, TextFormatText, invalid
from reasoning_engine.server.responses.store import (
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_STORED_RESPONSE_TTL_S,
    ResponseStore,
    StoredResponse,
)
from reasoning_engine.server.responses.translate import input_items, new_item_id, renamed, stored_item, to_chat_request
from reasoning_engine.server.routing import json_body, serve_prepared, session_key
from reasoning_engine.server.serving import OpenAIServing

_NO_STORED_RESPONSE = errors(404, words={404: "No stored response has this id (never stored, deleted or expired)."})


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"No stored response with id '{response_id}' (never stored, deleted or expired).",
                    param=param, code="not_found")


def _response_body(req: ResponsesRequest, response_id: str, model: str, created_at: int) -> dict[str, Any]:
    """The response object before its output: the request's settings echoed as OpenAI's API does."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else TextFormatText(type="text")
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
        "truncation": "disabled", "usage": None, "user": req.user, "prompt_cache_key": req.prompt_cache_key,
        "metadata": req.metadata or {},
    }


def register_responses_routes(app: FastAPI, serving: OpenAIServing, *,
                              max_stored: int = DEFAULT_MAX_STORED_RESPONSES,
                              stored_ttl_s: float = DEFAULT_STORED_RESPONSE_TTL_S) -> ResponseStore:
    """Add the Responses routes to `app`; returns their store (also `app.state.responses`)."""
    store = ResponseStore(max_stored, stored_ttl_s)
    app.state.responses = store

    @app.post("/v1/responses", responses=errors(400, 404, 503, words={
        404: "The model is not served here, or previous_response_id names no stored response."}))
    async def create_response(request: Request) -> Response:
        arrival = time.monotonic()
        req = await json_body(request, ResponsesRequest, invalid)
        model = serving.check_model(req.model)
        history = _history(store, req.previous_response_id)
        chat, message_params = to_chat_request(req, history, serving.max_model_len)
        try:
            prepared = await serving.prepare_chat(chat)
        except APIError as exc:
            raise renamed(exc, message_params) from exc
        error_param = prepared.error_param

        def param_of(message: str) -> str | None:
            param = error_param(message)
            return renamed(APIError(400, message, param=param), message_params).param if param else None

        prepared.error_param = param_of
        response_id = new_item_id("resp")
        body = _response_body(req, response_id, model, int(time.time()))
        own_items = [stored_item(item) for item, _ in input_items(req)]

        def keep() -> None:
            if req.store:
                store.put(StoredResponse(body, [*history, *own_items]))

        def run(engine_requests: EngineRequests) -> ResponseRun:
            return ResponseRun(serving, prepared, engine_requests, body, arrival)

        async def whole(engine_requests: EngineRequests) -> dict[str, Any]:
            async for _ in run(engine_requests).events():
                pass
            keep()
            return body

        try:  # errors after the stream started are events of it, in Responses terms already
            return await serve_prepared(request, serving.engine, prepared, response_id,
                                        session_key(request, req.prompt_cache_key, req.user), stream=req.stream,
                                        streamed=lambda runs: event_stream(run(runs), body, keep), whole=whole)
        except APIError as exc:
            raise renamed(exc, message_params) from exc

    @app.get("/v1/responses/{response_id}", responses=_NO_STORED_RESPONSE)
    async def get_response(response_id: str) -> Response:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.body)

    @app.delete("/v1/responses/{response_id}", responses=_NO_STORED_RESPONSE)
    async def delete_response(response_id: str) -> Response:
        if not store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items", responses={**_NO_STORED_RESPONSE, **errors(400)})
    async def list_input_items(
            response_id: str,
            order: Annotated[Literal["asc", "desc"], Query(description="asc: oldest item first")] = "desc",
            limit: Annotated[int, Query(ge=1, le=100, description="items in one page")] = 20,
            after: Annotated[str | None, Query(description="the page starts after this item id")] = None) -> Response:
        """The items a stored response's prompt was made of, paged as OpenAI's API pages them; parameters that fail
        their types are 400s (app.py)."""
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(_items_page(stored.input_items, order, limit, after))

    return store


def _history(store: ResponseStore, previous_response_id: str | None) -> list[dict[str, Any]]:
    """The conversation a request continues: the stored one `previous_response_id` names (404 if none), or none."""
    if previous_response_id is None:
        return []
    previous = store.get(previous_response_id)
    if previous is None:
        raise _not_found(previous_response_id, "previous_response_id")
    return previous.conversation


def _items_page(items: list[dict[str, Any]], order: str, limit: int, after: str | None) -> dict[str, Any]:
    """One page of a stored response's input items, as OpenAI's API pages them."""
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after: no input item with id {after[:100]!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}
