"""The OpenAI-compatible HTTP app: `build_app(engine, ServerConfig)`.

Every route parses its JSON itself (so broken JSON and wrong types are 400s naming the parameter, never FastAPI's
422), every error is an OpenAI error object, and every engine request is aborted when its client goes away.
Authentication and the body-size limit are plain ASGI middleware, so they guard every route, unknown ones included.
The browser playground (playground.py) is mounted at `/`; its static files are public, its API calls are not.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reasoning_engine import __version__
from reasoning_engine.multimodal.loading import MediaLoader
from reasoning_engine.server import openai_chat
from reasoning_engine.server.anthropic.errors import ANTHROPIC_ERROR_SCHEMA, is_anthropic_path
from reasoning_engine.server.anthropic.errors import error_response as anthropic_error_response
from reasoning_engine.server.anthropic.routes import register_anthropic_routes
from reasoning_engine.server.anthropic.schema import CountTokensRequest, MessagesRequest
from reasoning_engine.server.chat_template import (
    check_template_kwargs,
    read_chat_template,
    render_chat,
    with_chat_template,
)
from reasoning_engine.server.engine_client import EngineClient, ServedModelConfig
from reasoning_engine.server.engine_requests import ClientGone, new_request_id
from reasoning_engine.server.errors import APIError, bad_request, from_error_detail
from reasoning_engine.server.formats.registry import (
    REASONING_PARSER_CHOICES,
    TOOL_PARSER_CHOICES,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from reasoning_engine.server.metrics import ServerMetrics
from reasoning_engine.server.openapi import errors, install_openapi
from reasoning_engine.server.playground import PUBLIC_PATHS as PLAYGROUND_PUBLIC_PATHS
from reasoning_engine.server.playground import mount_playground
from reasoning_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from reasoning_engine.server.responses.routes import register_responses_routes
from reasoning_engine.server.responses.schema import ResponsesRequest
from reasoning_engine.server.responses.store import DEFAULT_MAX_STORED_RESPONSES, DEFAULT_STORED_RESPONSE_TTL_S
from reasoning_engine.server.routing import json_body, serve_prepared, session_key
from reasoning_engine.server.serving import OpenAIServing, check_tool_results, placeholder_messages

logger = logging.getLogger(__name__)
T = TypeVar("T", TokenizeRequest, DetokenizeRequest)
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MEDIA_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MEDIA_FETCH_TIMEOUT_S = 10.0
DEFAULT_MEDIA_REQUEST_TIMEOUT_S = 30.0


@dataclass
class ServerConfig:
    """Server-side settings (engine settings go to the engine)."""

    served_model_names: list[str] | None = None  # None: default_model_name(the checkpoint)
    api_key: str | None = None
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    max_thinking_tokens: int | None = None  # default thinking budget for requests that set none
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # where chat image and video URLs may point: data: URLs always, http(s) only to these hosts (and their
    # subdomains), file:// only under this folder; each item capped in bytes, (remote) in fetch seconds and in the
    # pixels it decodes (None: derived from the model's largest input, multimodal/loading.py default_pixel_limits);
    # a request's media all fetched, decoded and preprocessed within media_request_timeout
    allowed_media_domains: list[str] | None = None
    allowed_local_media_path: str | None = None
    media_max_bytes: int = DEFAULT_MEDIA_MAX_BYTES
    media_fetch_timeout: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S
    max_image_pixels: int | None = None
    max_video_pixels: int | None = None
    media_request_timeout: float = DEFAULT_MEDIA_REQUEST_TIMEOUT_S
    public_paths: tuple[str, ...] = ("/health", *PLAYGROUND_PUBLIC_PATHS)  # reachable without the API key
    shutdown_engine: bool = True  # shut the engine down when the app stops (False when apps share an engine)
    # stored Responses API responses (previous_response_id, GET): at most this many, each kept this long
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    stored_response_ttl_s: float = DEFAULT_STORED_RESPONSE_TTL_S
    chat_template: str | None = None  # a Jinja template, or a file holding one, rendering chats instead of the model's


def _error_response(path: str, error: APIError, headers: dict[str, str] | None = None) -> Response:
    """Anthropic's routes answer errors in Anthropic's shape (its SDK raises its own classes from it), the rest in
    OpenAI's."""
    if is_anthropic_path(path):
        return anthropic_error_response(error, headers)
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _AuthMiddleware:
    """`Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY` on every path but the public ones; the compares
    take constant time."""

    def __init__(self, app: ASGIApp, api_key: str, public_paths: tuple[str, ...]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._public = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._public:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer_ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        if bearer_ok or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self._key):
            return await self.app(scope, receive, send)
        error = APIError(401, "Incorrect API key provided. Send it as `Authorization: Bearer KEY` or "
                         "`x-api-key: KEY`.", code="invalid_api_key", type="invalid_request_error")
        await _error_response(scope["path"], error, {"WWW-Authenticate": "Bearer"})(scope, receive, send)


class _BodyLimitMiddleware:
    """Reads the request body up front and refuses it with 413 past `limit` bytes.

    An oversized body is drained (up to a cap) before answering, so a client still writing gets the 413 rather
    than a reset connection. The app then reads the buffered body, and later receive() calls (disconnects) go
    to the server as usual."""

    _DRAIN_CAP = 64 * 1024 * 1024

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self._limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self._limit + self._DRAIN_CAP):
            return await self._refuse(scope, receive, send, declared.isdigit())
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size <= self._limit:
                chunks.append(body)
            elif size > self._limit + self._DRAIN_CAP:
                break
            if not message.get("more_body", False):
                break
        if size > self._limit:
            return await self._refuse(scope, receive, send, True)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, too_large: bool) -> None:
        if too_large:
            error = APIError(413, f"Request body too large; the limit is {self._limit} bytes.",
                             code="request_too_large")
        else:
            error = bad_request("Invalid Content-Length header.")
        await _error_response(scope["path"], error)(scope, receive, send)


def _allowed_methods(app: FastAPI, request: Request) -> str:
    """The `Allow` header of a 405: every method some route takes at this path (Starlette's own header names only the
    first route's, and a path such as /v1/responses/{id} has a route per method)."""
    methods: set[str] = set()
    for route in app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


BUNDLED_MODEL_NAME = "tiny-reasoner"


def default_model_name(model_config: ServedModelConfig) -> str:
    """The checkpoint folder's name; the bundled model's folder is a generic `assets`, so it gets its own name."""
    from reasoning_engine.config import BUNDLED_MODEL_DIR

    path = getattr(model_config, "path", None)
    if path is not None and Path(path).resolve() == Path(BUNDLED_MODEL_DIR).resolve():
        return BUNDLED_MODEL_NAME
    return model_config.name


def build_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine`; several apps may share one engine (set `shutdown_engine=False` on all but one)."""
    config = config or ServerConfig()
    if config.reasoning_parser not in REASONING_PARSER_CHOICES:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_CHOICES)}")
    if config.tool_call_parser not in TOOL_PARSER_CHOICES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSER_CHOICES)}")
    serving = _serving(engine, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if config.shutdown_engine:
            await engine.shutdown()

    app = FastAPI(title="Reasoning Engine", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.serving = serving
    app.state.metrics = serving.metrics
    app.add_middleware(_BodyLimitMiddleware, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(_AuthMiddleware, api_key=config.api_key, public_paths=config.public_paths)
    _install_error_handlers(app)
    _register_server_routes(app, serving)
    _register_openai_routes(app, serving)
    register_responses_routes(app, serving, max_stored=config.max_stored_responses,
                              stored_ttl_s=config.stored_response_ttl_s)
    register_anthropic_routes(app, serving)
    install_openapi(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
                          "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
                          "/v1/messages/count_tokens": CountTokensRequest,
                          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest},
                    __version__, serving.model_names, api_key=bool(config.api_key), public_paths=config.public_paths,
                    streamed=("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"),
                    error_shapes={path: ("AnthropicError", ANTHROPIC_ERROR_SCHEMA)
                                  for path in ("/v1/messages", "/v1/messages/count_tokens")})
    mount_playground(app)
    return app


def _serving(engine: EngineClient, config: ServerConfig) -> OpenAIServing:
    """What the routes share, resolved once: the tokenizer (with the server's chat template), the served names,
    the parsers `auto` picks for the model, the media loader and the metrics."""
    model_config = engine.model_config
    tokenizer = engine.tokenizer
    if config.chat_template is not None:
        tokenizer = with_chat_template(tokenizer, read_chat_template(config.chat_template))
    vocab = set(tokenizer.get_vocab()) if tokenizer is not None else set()
    names = list(config.served_model_names or [default_model_name(model_config)])
    metrics = ServerMetrics(engine.stats, names[0])
    return OpenAIServing(
        engine, metrics, model_names=names,
        reasoning_parser=resolve_reasoning_parser(config.reasoning_parser, model_config.model_type, vocab),
        tool_parser=resolve_tool_parser(config.tool_call_parser, model_config.model_type, vocab,
                                        getattr(tokenizer, "chat_template", None)),
        max_thinking_tokens=config.max_thinking_tokens,
        media_loader=MediaLoader.for_model(
            engine.media_processor if engine.supports_media else None, list(config.allowed_media_domains or []),
            Path(config.allowed_local_media_path).resolve() if config.allowed_local_media_path else None,
            config.media_max_bytes, config.media_fetch_timeout, config.max_image_pixels, config.max_video_pixels),
        media_timeout=config.media_request_timeout, tokenizer=tokenizer)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error in the route's error shape (Anthropic's on its paths, OpenAI's elsewhere), never FastAPI's own."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return _error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(app, request)
        return _error_response(request.url.path, APIError(exc.status_code, str(exc.detail), code=code), headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request: Request, exc: RequestValidationError) -> Response:
        """A query or path parameter that fails its type: a 400 naming it, like every other bad input."""
        first = exc.errors()[0]
        error = from_error_detail({**first, "loc": tuple(first["loc"])[1:]})  # ("query", "limit") -> limit
        return _error_response(request.url.path, error)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return _error_response(request.url.path, APIError(500, f"Internal server error: {type(exc).__name__}"))


def _register_server_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """/health, /v1/models, /v1/engine/adaptive, /v1/kv_events and /metrics."""
    engine, model_config, names = serving.engine, serving.engine.model_config, serving.model_names

    @app.get("/health", responses=errors(503, words={503: "The engine loop has stopped (it died, or shut down)."}))
    async def health() -> Response:
        """200 while the engine loop runs; 503 once it has stopped, so a load balancer or supervisor stops sending
        requests that could only fail and restarts the server."""
        if not engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "reasoning-engine",
             "root": str(getattr(model_config, "path", name)), "max_model_len": serving.max_model_len}
            for name in names]})

    @app.get("/v1/engine/adaptive")
    async def adaptive() -> Response:
        return JSONResponse(engine.adaptive_snapshot())

    @app.get("/v1/kv_events", responses=errors(400))
    async def kv_events(after: int = Query(0, ge=0), replica: int = Query(0, ge=0),
                        limit: int = Query(1000, ge=1, le=10000)) -> Response:
        """The prefix cache's events after number `after`: blocks stored (with their parent's name and where they
        were filled from) and removed, for a router that follows what this server holds (engine/kv_events.py)."""
        try:
            return JSONResponse(engine.kv_events(after, replica, limit))
        except ValueError as exc:
            raise bad_request(str(exc), param="replica") from exc

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _register_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Chat and completions over the shared pipeline; /tokenize and /detokenize."""
    engine, tokenizer = serving.engine, serving.tokenizer

    async def openai_request(request: Request, body: type[ChatCompletionRequest | CompletionRequest],
                             id_prefix: str) -> Response:
        """A chat or completions request: its body, model and prepared engine requests, then the shared pipeline."""
        arrival = time.monotonic()
        req = await json_body(request, body)
        model = serving.check_model(req.model)
        if isinstance(req, ChatCompletionRequest):
            check_tool_results(req.messages)
            prepared = await serving.prepare_chat(req)
            streamed, whole = openai_chat.chat_stream, openai_chat.chat_full
        else:
            prepared = serving.prepare_completion(req)
            streamed, whole = openai_chat.completion_stream, openai_chat.completion_full
        return await serve_prepared(
            request, engine, prepared, new_request_id(id_prefix), session_key(request, req.prompt_cache_key, req.user),
            stream=req.stream, streamed=lambda runs: streamed(serving, req, model, prepared, runs, arrival),
            whole=lambda runs: whole(serving, req, model, prepared, runs, arrival))

    @app.post("/v1/chat/completions", responses=errors(400, 404, 503))
    async def chat_completions(request: Request) -> Response:
        return await openai_request(request, ChatCompletionRequest, "chatcmpl")

    @app.post("/v1/completions", responses=errors(400, 404, 503))
    async def completions(request: Request) -> Response:
        return await openai_request(request, CompletionRequest, "cmpl")

    async def tokenizer_request(request: Request, model: type[T]) -> T:
        """The body of a /tokenize or /detokenize request, for this model, which must have a tokenizer."""
        req = await json_body(request, model)
        serving.check_model(req.model)
        if tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return req

    @app.post("/tokenize", responses=errors(400, 404))
    async def tokenize(request: Request) -> Response:
        req = await tokenizer_request(request, TokenizeRequest)
        if req.messages is not None:
            refs = serving.media_refs(req.messages)
            rendered = render_chat(tokenizer, placeholder_messages(req.messages, refs), tools=req.tools,
                                   template_kwargs=check_template_kwargs(dict(req.chat_template_kwargs or {})),
                                   add_generation_prompt=req.add_generation_prompt)
            ids = await serving.media_prompt_ids(rendered.token_ids, refs)  # an image counts as all its tokens
        else:
            ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize", responses=errors(400, 404))
    async def detokenize(request: Request) -> Response:
        req = await tokenizer_request(request, DetokenizeRequest)
        if any(t < 0 or t >= serving.vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {serving.vocab_size})", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens)})
