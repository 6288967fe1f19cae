"""`POST /v1/messages` through the shared pipeline (routing.serve_prepared) and `POST /v1/messages/count_tokens`;
errors on these paths take Anthropic's shape (errors.py) through the app's handlers."""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from reasoning_engine.server.anthropic.errors import PATH_PREFIX
from reasoning_engine.server.anthropic.replies import Reply, reply_stream, reply_whole
from reasoning_engine.server.anthropic.schema import (
    CountTokensRequest,
    MessagesRequest,
    ThinkingAdaptive,
    ThinkingEnabled,
)
from reasoning_engine.server.anthropic.translate import count_prompt_tokens, translate
from reasoning_engine.server.chat_run import ChatRun
from reasoning_engine.server.engine_requests import EngineRequests, new_request_id
from reasoning_engine.server.errors import APIError, bad_request
from reasoning_engine.server.openapi import errors
from reasoning_engine.server.routing import json_body, serve_prepared, session_key
from reasoning_engine.server.serving import OpenAIServing, Prepared

INTERLEAVED_THINKING_BETA = "interleaved-thinking-"  # its `anthropic-beta` names let the budget pass max_tokens


def register_anthropic_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Add `/v1/messages` and `/v1/messages/count_tokens`. Errors on these paths take Anthropic's shape through the
    app's handlers (`is_anthropic_path`)."""

    @app.post(PATH_PREFIX, responses=errors(400, 404, 503))
    async def messages(request: Request) -> Response:
        arrival = time.monotonic()
        req = await json_body(request, MessagesRequest)
        check_thinking_budget(req, request.headers.get("anthropic-beta", ""))
        translation = translate(req)
        chat = translation.chat
        display = req.thinking.display if isinstance(req.thinking, (ThinkingEnabled, ThinkingAdaptive)) else None
        try:
            model = serving.check_model(req.model)
            prepared = await serving.prepare_chat(chat)
            clamped = _clamp_max_tokens(prepared, req.max_tokens)
            request_id = new_request_id("msg")
            reply = Reply(_message_id(request_id), model, clamped, show_thinking=display != "omitted")

            def run(engine_requests: EngineRequests) -> ChatRun:
                return ChatRun(serving, engine_requests, prepared, arrival)

            return await serve_prepared(
                request, serving.engine, prepared, request_id, session_key(request, chat.user), stream=req.stream,
                streamed=lambda runs: reply_stream(run(runs), reply, translation),
                whole=lambda runs: reply_whole(run(runs), reply))
        except APIError as exc:
            raise translation.names.error(exc) from exc

    @app.post(PATH_PREFIX + "/count_tokens", responses=errors(400, 404))
    async def count_tokens(request: Request) -> Response:
        req = await json_body(request, CountTokensRequest)
        translation = translate(req)
        try:
            serving.check_model(req.model)
            return JSONResponse({"input_tokens": await count_prompt_tokens(serving, translation.chat)})
        except APIError as exc:
            raise translation.names.error(exc) from exc


def check_thinking_budget(req: MessagesRequest, betas: str) -> None:
    """`thinking.budget_tokens` below `max_tokens`, as Anthropic requires, unless the `anthropic-beta` header turns
    on interleaved thinking, whose budget spans all the thinking blocks of the turn and may pass max_tokens."""
    if not isinstance(req.thinking, ThinkingEnabled) or req.thinking.budget_tokens < req.max_tokens:
        return
    if any(beta.strip().startswith(INTERLEAVED_THINKING_BETA) for beta in betas.split(",")):
        return
    raise bad_request(f"thinking.budget_tokens: must be less than max_tokens ({req.max_tokens}), which counts the "
                      "thinking too", param="thinking.budget_tokens", code="invalid_value")


def _clamp_max_tokens(prepared: Prepared, requested: int) -> bool:
    """Cut `max_tokens` to the room the prompt leaves (prepare_chat was given none, so its limit is that room, or
    None with media, where only the engine knows it); True when it was cut."""
    room = prepared.params.max_tokens
    prepared.params = replace(prepared.params, max_tokens=requested if room is None else min(requested, room))
    return room is not None and requested > room


def _message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("msg-")
